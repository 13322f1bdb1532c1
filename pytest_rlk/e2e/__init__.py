"""End-to-end A/B tier: one spec, two arms (baseline vs kernels), gates and a report.

- `spec`: the A/B spec (pydantic) and the "arms differ only by the kernel switch" check
- `metrics`: canonical per-step metric names, bands (with sources) and windows for every engine
- `gates`: engine-agnostic gates (`gate_lane`, `pair_verdict`) over per-arm series
- `report`: plots and the reproducibility Markdown
- vime engine: `vime_engine` (commands), `launcher` (own Ray head, job submit, teardown),
  `vime_log` (stdout parser), `tensorboard` (event-file reader), `nvml` (peak memory), `ab` (runs)
- `engines/`: other engines (TRL)
- `cli`: `rlk e2e plan|run|list`
"""
