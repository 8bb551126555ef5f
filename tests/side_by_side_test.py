"""launch/side_by_side.py: its short errors when the official checkout or torch is missing, and
its reading of the official code's log. Needs no torch and runs neither code."""
import stat

import pytest

from conftest import load_file


def load_script():
  return load_file('launch/side_by_side.py')


# The official FedSSA_hetero.py's log (logging's format from experiments/utils.py), two rounds:
# tqdm's bar ends without a newline, so a round's first line can follow it on the same line.
LOG = """\
side_by_side runner: torch 2.14.1+cu130, 2 threads
2026-11-30 19:42:22,801 - root - INFO - auto embedding size
  0%|          | 0/2 [00:00<?, ?it/s]/x/dataloader.py:759: UserWarning: 'pin_memory' ...
  super().__init__(loader)
2026-11-30 19:42:32,692 - root - INFO - #-----------Round:0-------------#
/x/loss.py:48: UserWarning: size_average and reduce args will be deprecated
2026-11-30 19:42:39,120 - root - INFO - round 0 | client 9 | acc:0.5378967604712042
2026-11-30 19:43:40,327 - root - INFO - Round:0 | mean_local_loss:1.7319999933242798 | mean_local_acc:0.5215
2026-11-30 19:43:40,327 - root - INFO - Global Headers are updated after aggregation
 50%|#####     | 1/2 [01:17<01:17, 77.47s/it]2026-11-30 19:43:40,328 - root - INFO - #-----------Round:1-------------#
2026-11-30 19:44:50,755 - root - INFO - Round:1 | mean_local_loss:0.8170999884605408 | mean_local_acc:0.595
2026-11-30 19:44:50,755 - root - INFO - Global Headers are updated after aggregation
100%|##########| 2/2 [02:27<00:00, 73.33s/it]
2026-11-30 19:44:50,756 - root - INFO - Results json have saved successfully!
Finished Collection!
"""


def test_reads_round_times_and_accuracies_from_the_official_log():
  sbs = load_script()
  assert sbs.official_round_times(LOG) == pytest.approx([67.635, 70.427], abs=1e-6)
  assert sbs.official_accuracies(LOG) == [0.5215, 0.595]
  assert sbs.steady([67.635, 70.427, 72.0]) == pytest.approx(71.2135)


def test_a_round_without_its_end_is_not_timed():
  cut = LOG[:LOG.index('2026-11-30 19:44:50,755')]
  assert load_script().official_round_times(cut) == pytest.approx([67.635], abs=1e-6)


@pytest.mark.parametrize('where', ['missing', 'empty'])
def test_a_missing_checkout_says_how_to_get_one(tmp_path, where, capsys):
  path = str(tmp_path / 'nothing') if where == 'missing' else str(tmp_path)
  with pytest.raises(SystemExit) as exit_:
    load_script().main([f'--official={path}'])
  message = str(exit_.value.code)
  assert message.startswith(f'side_by_side: --official={path} ')
  assert 'git clone' in message and '\n' not in message
  assert not capsys.readouterr().out  # nothing ran


def test_finds_the_scripts_folder_from_the_checkouts_root_or_itself(tmp_path):
  sbs = load_script()
  script = tmp_path / 'FedSSA' / 'experiments' / 'FLHetero' / 'FedSSA_hetero.py'
  script.parent.mkdir(parents=True)
  script.write_text('')
  assert sbs.find_official(str(tmp_path)) == str(tmp_path / 'FedSSA')
  assert sbs.find_official(str(tmp_path / 'FedSSA')) == str(tmp_path / 'FedSSA')


def test_a_python_without_torch_says_how_to_get_one(tmp_path):
  sbs = load_script()
  fake = tmp_path / 'python'
  fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
  fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
  for python, why in ((str(fake), "No module named 'torch'"),
                      (str(tmp_path / 'absent'), 'cannot be run')):
    with pytest.raises(sbs.Failure) as failure:
      sbs.check_official_python(python)
    message = str(failure.value)
    assert why in message and 'pip install torch torchvision' in message
    assert '--official_python=' in message
