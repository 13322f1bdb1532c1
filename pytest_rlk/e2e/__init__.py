"""End-to-end A/B tier: one spec, two arms (baseline vs kernels), gates and a report.

- `spec`: the A/B spec (pydantic; each engine's section validated by the engine's own model)
- `arms`: resolved arm commands and the "arms differ only by the kernel switch" check
- `engine`: the contract every engine meets; `engines/<name>/`: the engines (vime, trl), by name
- `runner`: the one A/B runner (plan, run, gate, report) over any engine; `outcome`: its results
- `launcher`: the one subprocess launcher (local and Ray job modes; `processes`, `ray_head`)
- `metrics`, `gates`, `report`: canonical metric names and bands, engine-agnostic gates, the report
- `progress`, `placeholders`, `tensorboard`, `nvml`: progress lines, `${VAR}` paths, event files, GPU memory
- `cli`: `rlk e2e list|plan|run`
"""
