"""Where does train/rollout drift come from? The A0-A5 alignment ladder.

``train_rollout_logprob_abs_diff`` says that training and rollout disagree, not why. The ladder
measures the same response tokens' log-probs along rungs that each change exactly one source of
mismatch from a fully aligned reference (A0: the same forward twice), then pairs of them (A4),
then production (A5: a real vLLM rollout against the training forward with the kernels), and
states which rung explains how much of A5's drift.

Modules (plain code; the pytest tests in suites/module/drift/ and ``rlk drift`` are thin):

* rungs.py: the rungs, the factors a side varies (:class:`SideConfig`), the default comparisons,
  and the check that a comparison changes exactly its rung's factors;
* preconditions.py: what both sides must share (checkpoint, token ids, masks, sampling, space)
  and the check that refuses a comparison otherwise;
* batch.py: the token sequences every rung scores; rollout.py: vLLM in a subprocess;
* arith.py, sides.py, tp.py: the training forward under each side's arithmetic, layout and dtype;
* diagnostics.py: |dlogp| quantiles, ratio0, clipfrac0, approx_kl0, worst token, layout fingerprints,
  and every metric of the mismatch table (pytest_rlk/mismatch);
* contracts.py: each comparison's contract and gate band, from kernels/tolerances.py;
* runner.py, table.py, mismatch_table.py, plot.py: run the ladder, the drift table with the
  attribution and the mismatch metrics, the plot;
* semantics.py: rung S, what the rollout's and the training's log-probs mean (temperature, top-k,
  top-p on each side; vLLM's raw vs processed log-probs), named and measured;
* precision.py: the precision matrix (rollout bf16 / fp16 x training bf16 / fp16 / fp32);
* cli.py: ``rlk drift`` / ``python -m pytest_rlk.drift``.
"""
