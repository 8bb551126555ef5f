"""LG-FedAvg (Liang et al. 2020) sharing the whole header (docs/algorithm.md §6).

Unlike FedSSA, which exchanges only the rows of a client's seen classes and averages them class
by class, LG-FedAvg shares the *whole* header H = fc3 as a [C, d + 1] table (row c = (W[c], b[c]),
d = model.feature_dim):

- Server state: the global header H_g. It starts as one fresh header drawn from the server's key
  with a client header's init (models.Dense: PyTorch's U(+-1/sqrt(d)) for weights and bias).
  This is the common initial header (HtFLlib takes client 0's initial header; ours is an
  independent draw from the same distribution).
- Download: a participant overwrites its whole header with H_g, unseen-class rows included.
- Objective: plain CE over the whole model (base.Method.loss).
- Upload: the trained header, plus n_k as metadata for the weighting.
- Server: H_g = sum_k n_k H_k / sum_k n_k over this round's participants (`weighting='samples'`,
  the default, as HtFLlib) or their unweighted mean (`'uniform'`, the original code). The
  uploads are summed as they arrive (an inbox kept apart from H_g, which clients download) and
  divided once per round; a round with no upload keeps H_g.
- Inference (docs/algorithm.md §5): every client's local extractor with the latest H_g.
- Floats: (d + 1) C down and (d + 1) C up per participant (n_k is metadata, not counted). Evaluating
  non-participants with H_g implies HtFLlib's broadcast to all N clients, which is not counted.

The exchange is headers.SharedHeader's, which FedClassAvg (fedclassavg.py) shares with its own
loss.
"""
from __future__ import annotations

from fedssa_jax.methods import headers


class LGFedAvg(headers.SharedHeader):
  name = 'lg_fedavg'
  eval_reads_server = eval_server_header = True  # evaluated with the latest H_g

  def eval_header(self, server, client_id):
    return server.global_header
