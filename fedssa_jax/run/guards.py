"""The divergence guards: a NaN or inf in a client's loss or parameters, or a finite loss that
blew up (the `guard` config), stops a run before anything of the round is saved."""
from __future__ import annotations

import numpy as np

from fedssa_jax.run import checkpoint


class DivergenceError(FloatingPointError):
  """A NaN or inf in a client's training loss or parameters, or a loss that blew up (the
  `guard` config); nothing of the round was saved."""


def check_finite(sim, state, info, ckpts: checkpoint.Checkpointer) -> None:
  """Raises DivergenceError naming the round, clients and families with a NaN or inf."""
  problems = {}  # client id -> what is not finite
  cohort = info.cohort
  for c in cohort[~np.isfinite(info.train_loss_sum)]:
    problems.setdefault(int(c), []).append('loss')
  # Only the clients that trained this round have new parameters (the engine checks them).
  for c in cohort[info.nonfinite_params]:
    problems.setdefault(int(c), []).append('parameters')
  if not problems:
    return
  by_family = {}
  for c in sorted(problems):
    by_family.setdefault(sim.groups[sim.group_of[c]].family, []).append(
        f'{c} ({" and ".join(problems[c])})')
  where = '; '.join(f'family {f}: clients {", ".join(cs)}' for f, cs in by_family.items())
  raise DivergenceError(
      f'Training diverged in round {state.round}: a NaN or inf in the training loss or '
      f'parameters of {where}. Nothing of this round was saved; {_kept(ckpts)}. A resume must '
      'keep the config, so start again in a new --workdir with a smaller optimizer.lr or '
      'optimizer.clip_norm.')


def _kept(ckpts: checkpoint.Checkpointer) -> str:
  steps = ckpts.steps()
  return (f'the last good checkpoint, of round {steps[-1]}, is kept intact in '
          f'{ckpts.directory}' if steps else 'no checkpoint was written')


def best_train_loss(best: float | None, info) -> float | None:
  """The lowest round train loss so far (check_blowup's `best`) after the round of `info`; a
  round that trained no sample (FedL2G's warm-up, Method.trains) has no train loss and leaves
  it as it was."""
  if info.train_samples.sum() == 0:
    return best
  return info.train_loss if best is None or info.train_loss < best else best


def check_blowup(config, sim, state, info, best: float | None,
                 ckpts: checkpoint.Checkpointer) -> None:
  """Raises DivergenceError when the round's (finite) train loss blew up: above
  guard.max_train_loss, or above guard.loss_growth times `best` (the lowest round loss so far)
  and above ln(classes), a uniform guess's cross-entropy. Names the round, the statistic and
  the clients whose own loss is past the same bound."""
  g, loss = config.guard, info.train_loss
  chance = float(np.log(sim.num_classes))
  if g.max_train_loss and loss > g.max_train_loss:
    bound = g.max_train_loss
    stat = (f'the mean train loss {loss:.4g} is above guard.max_train_loss='
            f'{g.max_train_loss:g}')
  elif g.loss_growth and best is not None and loss > max(g.loss_growth * best, chance):
    bound = max(g.loss_growth * best, chance)
    stat = (f'the mean train loss {loss:.4g} is {loss / best:.3g} times the best round\'s '
            f'{best:.4g}, above guard.loss_growth={g.loss_growth:g} (and above ln(classes) = '
            f'{chance:.3g})')
  else:
    return
  client_loss = info.train_loss_sum / np.maximum(info.train_samples, 1)
  tripped = [f'{c} ({l:.3g})' for c, l in zip(info.cohort, client_loss) if l > bound]
  raise DivergenceError(
      f'Training blew up in round {state.round}: {stat}; clients (loss) past it: '
      f'{", ".join(tripped) or "none alone"}. Nothing of this round was saved; {_kept(ckpts)}. '
      'Start again in a new --workdir with a smaller optimizer.lr or optimizer.clip_norm (or '
      'raise or turn off the guard with --config.guard.max_train_loss / loss_growth; 0 is off).')
