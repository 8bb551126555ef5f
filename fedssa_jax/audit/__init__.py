"""A privacy audit: an empirical lower bound on epsilon beside the accounted one, and a
membership inference attack's advantage (docs/operations.md, "Auditing a config";
docs/algorithm.md §11, "Auditing").

  python -m fedssa_jax.audit --config=... --workdir=... [--config.* overrides] [--canaries=m]

1. **Training-data canaries** (any config): m canaries (an image from outside every training
   split with a label other than its own, drawn among its owner's seen classes), each included
   in its owner's training split independently with probability 1/2 (Steinke, Nasr and
   Jagielski 2023, "Privacy auditing with one (1) training run"), from the run's seed
   (Stream.AUDIT). The config trains once through the engine (simulator.Simulator, its
   accountants following the rounds as a run's do), and each canary is scored minus its
   owner's personalised model's loss on it. JAX-Privacy's `CanaryScoreAuditor` turns the
   scores into a lower bound on epsilon at the run's delta that holds with 95% confidence,
   beside DP-SGD's accounted epsilon (none without DP-SGD: the audit of no DP).
2. **Upload canaries** (privacy.upload on): a mechanism-level audit of the engine's own clip and
   noise code (uploads.py). It reads no data and no model: `--notrain` runs it alone
   (run.mechanism_audit), without the other two.
3. **Membership inference**: a loss threshold's advantage (max over thresholds of TPR - FPR;
   Yeom et al. 2018), members every client's training samples and non-members its test
   samples, each scored by its own client's model, pooled over the clients.

A lower bound above the accounted epsilon, at 95% confidence, is a bug in the mechanism or its
accounting. The audit writes audit.json (no checkpoints: it is not resumed) into --workdir.

- canaries.py  the canaries and their draws
- losses.py    each client's per-sample loss on a set of rows
- scores.py    the lower bound, AUROC, the MIA's advantage, and the canaries' ceiling
- uploads.py   the uploads' mechanism-level audit
- run.py       run_audit: the run, the audits, audit.json and the console's table
"""
