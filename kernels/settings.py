"""Every environment variable pytest-rlk reads: its name, type, default, what it does, who reads it.

A setting is read where it is used, through its :class:`Setting` here (``settings.KERNELS.get()``),
never through ``os.environ`` directly, so this table is complete: ``rlk env`` prints each
setting's effective value and source, and ``docs/settings.md`` is rendered from it
(:func:`render_markdown`; ``rlk env --markdown``).

Reads are cheap enough to happen on every call of an op (tests flip switches with
``monkeypatch.setenv`` between calls): :meth:`Setting.get` looks the raw value up in
``os.environ``'s own bytes store and keeps the parsed value of each raw value it has seen, so a
read is one dict lookup and one cache hit.

Parsing is the same for every setting of a type. A flag takes ``1/true/yes/on`` or
``0/false/no/off`` (any case); unset or blank gives the default; anything else raises
``ValueError`` naming the variable, at the first read. This module imports nothing beyond the
standard library, so the plugin and ``rlk env`` can read settings without importing torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_POSIX = os.name == "posix"
_CACHE_LIMIT = 64  # distinct raw values remembered per setting


def parse_flag(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}")


def parse_check_mode(text: str) -> str:
    """``strict``, or a flag word: ``on`` / ``off``."""
    if text.lower() == "strict":
        return "strict"
    try:
        return "on" if parse_flag(text) else "off"
    except ValueError:
        raise ValueError(f"expected strict, {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}") from None


def parse_text(text: str) -> str:
    return text


def parse_path(text: str) -> Path:
    return Path(text).expanduser()


def parse_positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise ValueError("expected a positive int")
    return int(text)


def parse_positive_int_or_auto(text: str) -> int | str:
    """``auto`` (the reader works the number out) or a positive int."""
    return "auto" if text.strip() == "auto" else parse_positive_int(text)


def parse_op_list(text: str) -> frozenset[str] | None:
    """``*`` -> None (every op); ``logp,grpo_loss`` -> their names."""
    if text == "*":
        return None
    names = frozenset(part.strip() for part in text.split(",") if part.strip())
    return None if "*" in names else names


def choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"expected one of {options}")
        return text

    parse.__name__ = f"one of {'|'.join(options)}"
    return parse


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of a tiled kernel."""

    block_t: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int


def parse_tiles(text: str) -> TileConfig:
    """``"BLOCK_T,BLOCK_V,BLOCK_K,num_warps,num_stages"``: positive ints, blocks powers of two >= 16."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError("expected 'BLOCK_T,BLOCK_V,BLOCK_K,num_warps,num_stages' (positive ints)")
    tiles = TileConfig(*(int(p) for p in parts))
    for block in (tiles.block_t, tiles.block_v, tiles.block_k):
        if block < 16 or block & (block - 1):
            raise ValueError("block sizes must be powers of two >= 16")
    return tiles


_TYPE_NAMES = {parse_flag: "flag", parse_check_mode: "on, strict or off", parse_text: "text", parse_path: "path", parse_positive_int: "positive int",
               parse_positive_int_or_auto: "positive int or auto",
               parse_op_list: "op list", parse_tiles: "tiles"}


class Setting(Generic[T]):
    """One environment variable: ``get()`` is its parsed value now (the default when unset or blank).

    ``read`` says when the product reads it (``every call``: a change takes effect at the next
    call; ``at import``: fixed for the process; ``when used``), ``readers`` which files do."""

    __slots__ = ("_key", "_values", "default", "group", "help", "name", "parse", "read", "readers")

    def __init__(self, name: str, parse: Callable[[str], T], default: T, help: str, *, readers: tuple[str, ...],
                 read: str = "every call", group: str = "kernels") -> None:
        self.name = name
        self.parse = parse
        self.default = default
        self.help = help
        self.readers = readers
        self.read = read
        self.group = group
        self._key = os.fsencode(name)
        self._values: dict[Any, T] = {}

    def raw(self) -> str | None:
        """The variable's text as set (None when unset)."""
        return os.environ.get(self.name)

    def get(self) -> T:
        # os.environ keeps its bytes store in ``_data`` on POSIX CPython, updated by every set and
        # delete through os.environ (monkeypatch.setenv included); a bytes lookup there skips the
        # str round trip and, for an unset name, the KeyError os.environ.get raises inside.
        data = getattr(os.environ, "_data", None)
        raw = data.get(self._key) if type(data) is dict and _POSIX else os.environ.get(self.name)
        try:
            return self._values[raw]
        except KeyError:
            pass
        value = self._parse_raw(raw)
        if len(self._values) < _CACHE_LIMIT:
            self._values[raw] = value
        return value

    def _parse_raw(self, raw: bytes | str | None) -> T:
        text = (os.fsdecode(raw) if isinstance(raw, bytes) else raw or "").strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{self.name}={text!r}: {exc}") from None

    def source(self) -> str:
        """``environment`` or ``default``."""
        return "environment" if (self.raw() or "").strip() else "default"

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES.get(self.parse, getattr(self.parse, "__name__", "text"))

    def __repr__(self) -> str:
        return f"<setting {self.name}>"


SETTINGS: dict[str, Setting[Any]] = {}


def _declare(setting: Setting[T]) -> Setting[T]:
    if setting.name in SETTINGS:
        raise ValueError(f"setting {setting.name} declared twice")
    SETTINGS[setting.name] = setting
    return setting


# -- which implementation serves an op (kernels/dispatch.py) ------------------------------------
KERNELS = _declare(Setting(
    "VIME_RL_KERNEL", parse_flag, False,
    "Run the ops on the kernel backend. Off: every op runs the fp32 reference, and that is not a fallback "
    "(the vime custom loss then hands its calls to vime's own loss).",
    readers=("kernels/dispatch.py", "kernels/integrations/vime.py", "kernels/integrations/trl.py")))
OPS = _declare(Setting(
    "VIME_RL_KERNEL_OPS", parse_op_list, None,
    "Comma-separated ops the kernel backend may serve (`logp,grpo_loss`); `*` or unset: all. Other ops "
    "run the reference, silently.",
    readers=("kernels/dispatch.py",)))
BACKEND = _declare(Setting(
    "VIME_RL_KERNEL_BACKEND", parse_text, "rlk-triton",
    "The kernel backend: a built-in or registered name, an entry point of `pytest_rlk.backends`, or "
    "`pkg.module:factory`. `--rlk-backend` sets it for a test run.",
    readers=("kernels/dispatch.py", "pytest_rlk/plugin.py (writes it)")))
STRICT = _declare(Setting(
    "VIME_RL_KERNEL_STRICT", parse_flag, False,
    "A fallback to the reference raises `KernelFallbackError` instead of logging and counting it.",
    readers=("kernels/dispatch.py", "kernels/integrations/vime.py")))

# -- input checks (kernels/contracts/checks.py) ---------------------------------------------------
CHECK_IDS = _declare(Setting(
    "VIME_RL_KERNEL_CHECK_IDS", parse_check_mode, "on",
    "Check that target ids lie in the vocab and packed lengths are consistent. `on`: CPU inputs on the "
    "host; on a GPU the kernels check and report through a per-device error word, raised at the next "
    "call or by `kernels.raise_pending_errors()` (no host sync). `strict`: on the host before every "
    "launch (one host sync per check). `off`: only the kernels' own report.",
    readers=("kernels/contracts/checks.py",)))
CHECK_FINITE = _declare(Setting(
    "VIME_RL_KERNEL_CHECK_FINITE", parse_flag, False,
    "Reject NaN/Inf logits (reads the whole logits tensor once more).",
    readers=("kernels/contracts/checks.py",)))

# -- launching (kernels/launch.py, kernels/ops/) ------------------------------------------------
FAST_LAUNCH = _declare(Setting(
    "VIME_RL_KERNEL_FAST_LAUNCH", parse_flag, True,
    "Launch repeat calls of a Triton kernel without Triton's Python launcher (host time of small calls).",
    readers=("kernels/launch.py",), read="at import"))
VERIFY_LAUNCH_KEYS = _declare(Setting(
    "RLK_VERIFY_LAUNCH_KEYS", parse_flag, False,
    "Every keyed launch re-derives Triton's specialization and checks it against the op's launch key "
    "(the GPU tests run the ops this way).",
    readers=("kernels/launch.py",), read="at import"))
GRPO_ONE_READ = _declare(Setting(
    "RLK_GRPO_ONE_READ", parse_flag, True,
    "Let grpo_loss use the one-read CUDA cluster kernel where it applies; off: the two-read Triton path.",
    readers=("kernels/ops/cuda/grpo_loss_one_read.py",)))

# -- linear_logp tuning (kernels/ops/linear_logp/; GPU only) ---------------------------------------
LINEAR_LOGP_TILES = _declare(Setting(
    "RLK_LINEAR_LOGP_TILES", parse_tiles, None,
    "Tiles of the logits-tile kernels, `BLOCK_T,BLOCK_V,BLOCK_K,num_warps,num_stages`; unset: the "
    "built-in configs.",
    readers=("kernels/ops/linear_logp/plan.py",)))
LINEAR_LOGP_MATMUL_TILES = _declare(Setting(
    "RLK_LINEAR_LOGP_MATMUL_TILES", parse_tiles, None,
    "Tiles of the backward's Triton matmul (with `RLK_LINEAR_LOGP_BWD_MATMUL=triton`), same format.",
    readers=("kernels/ops/linear_logp/plan.py",)))
LINEAR_LOGP_BWD_MATMUL = _declare(Setting(
    "RLK_LINEAR_LOGP_BWD_MATMUL", choice("torch", "triton"), "torch",
    "The backward's dH/dW matmuls: `torch` (cuBLAS, fp32 output) or `triton` (ours).",
    readers=("kernels/ops/linear_logp/plan.py",)))
LINEAR_LOGP_TMA = _declare(Setting(
    "RLK_LINEAR_LOGP_TMA", parse_flag, True,
    "Use the persistent TMA kernel for bf16/fp16 on Hopper or newer; off: the pointer kernels.",
    readers=("kernels/ops/linear_logp/launch.py",)))
LINEAR_LOGP_SAVE_LOGITS = _declare(Setting(
    "RLK_LINEAR_LOGP_SAVE_LOGITS", parse_flag, True,
    "The forward keeps as many logits (as exponentials) as the workspace budget holds, so the backward "
    "recomputes only the rest; off: it keeps none and the backward recomputes them all.",
    readers=("kernels/ops/linear_logp/plan.py",)))
LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD = _declare(Setting(
    "RLK_LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD", parse_flag, True,
    "Where the workspace budget cannot hold the logits, the weight needs a gradient and T <= H, the "
    "forward allocates the weight gradient and keeps every logit (as exponentials) in it: "
    "forward+backward in three matrix products within the budget, the [V, H] gradient held from the "
    "forward on; off: only what the budget holds is kept.",
    readers=("kernels/ops/linear_logp/plan.py",)))
LINEAR_LOGP_WORKSPACE_BYTES = _declare(Setting(
    "RLK_LINEAR_LOGP_WORKSPACE_BYTES", parse_positive_int, None,
    "The memory linear_logp may hold beyond its inputs, output and gradients, in bytes, where a call "
    "passes no `workspace_bytes`; unset: 256000000, raised where the shape needs more for chunks of 4096 "
    "vocab columns. The logits' size (T x V x 2 bytes, 16-bit inputs) plus ~2% keeps them all: "
    "forward+backward in three matrix products instead of four.",
    readers=("kernels/ops/linear_logp/plan.py",)))
LINEAR_LOGP_GROUP_T = _declare(Setting(
    "RLK_LINEAR_LOGP_GROUP_T", parse_positive_int, None,
    "Token tiles per group in the TMA kernel's tile order; unset: token tile fastest over all T.",
    readers=("kernels/ops/linear_logp/launch.py",)))

# -- native builds (kernels/ops/cuda/, kernels/ops/host/) ----------------------------------------
NVCC = _declare(Setting(
    "RLK_NVCC", parse_path, None,
    "The nvcc that builds the CUDA kernels; unset: nvcc on PATH, then `$CUDA_HOME/bin/nvcc` (or `$CUDA_PATH`).",
    readers=("kernels/ops/cuda/build.py",), read="when used"))
CXX = _declare(Setting(
    "RLK_CXX", parse_path, None,
    "The C++ compiler of the host paths; unset: `$CXX`, then g++ or c++ on PATH.",
    readers=("kernels/ops/host/build.py",), read="when used"))
CUDA_CACHE = _declare(Setting(
    "RLK_CUDA_CACHE", parse_path, Path("~/.cache/pytest-rlk/cuda"),
    "Where built CUDA fatbins and host-path modules are cached.",
    readers=("kernels/ops/cuda/build.py", "kernels/ops/host/build.py"), read="when used"))

# -- integrations and backends -------------------------------------------------------------------
NATIVE_LOSS = _declare(Setting(
    "VIME_RL_KERNEL_NATIVE_LOSS", parse_text, "vime.backends.megatron_utils.loss:policy_loss_function",
    "vime's own policy loss (`module:function`): the vime adapter hands it every call with the kernels off, "
    "and the calls it cannot compute exactly.",
    readers=("kernels/integrations/vime.py",), read="when used"))
RL_ENGINE_PATH = _declare(Setting(
    "RLK_RL_ENGINE_PATH", parse_path, None,
    "An RL-Kernel checkout to put on sys.path for the `rl_engine` backend.",
    readers=("kernels/backends/rl_engine.py",), read="when used"))
TRITON_INTERPRET = _declare(Setting(
    "TRITON_INTERPRET", parse_text, "",
    "Triton's own switch: `1` runs Triton kernels on CPU tensors through its interpreter. It must be set "
    "before `kernels.ops` is first imported.",
    readers=("kernels/ops/__init__.py", "kernels/backends/triton.py", "kernels/backends/adapter_common.py"),
    read="at import", group="third party"))
TOOLCHAIN_CXX = _declare(Setting(
    "CXX", parse_text, None,
    "The conventional C++ compiler variable, used for the host paths when `RLK_CXX` is unset.",
    readers=("kernels/ops/host/build.py",), read="when used", group="third party"))
CUDA_HOME = _declare(Setting(
    "CUDA_HOME", parse_path, None,
    "The CUDA toolkit, searched for nvcc when `RLK_NVCC` is unset and no nvcc is on PATH.",
    readers=("kernels/ops/cuda/build.py",), read="when used", group="third party"))
CUDA_PATH = _declare(Setting(
    "CUDA_PATH", parse_path, None,
    "The CUDA toolkit where `CUDA_HOME` is unset (the Windows installer's name for it).",
    readers=("kernels/ops/cuda/build.py",), read="when used", group="third party"))

# -- the suite ---------------------------------------------------------------------------------
SUITE_COMMIT = _declare(Setting(
    "RLK_SUITE_COMMIT", parse_text, None,
    "This suite's commit, for run manifests of a copied tree (it wins over the copy's .git).",
    readers=("pytest_rlk/manifest.py", ".ci/gpu-nightly (passes it on)", "pytest_rlk/nightly/ray_driver.py (passes it on)"),
    read="when used", group="suite"))
NIGHTLY_DIR = _declare(Setting(
    "RLK_NIGHTLY_DIR", parse_path, Path(".rlk/nightly"),
    "The GPU nightly job's output folder (its runs go to `<dir>/runs`), relative to the checkout.",
    readers=(".ci/gpu-nightly",), read="when used", group="suite"))
NIGHTLY_TAG = _declare(Setting(
    "RLK_NIGHTLY_TAG", parse_text, None,
    "Name of the nightly job's tarball (`rlk-gpu-<tag>.tar.gz`); unset: `<platform>-<UTC time>`.",
    readers=(".ci/gpu-nightly",), read="when used", group="suite"))
NIGHTLY_WORKERS_PER_GPU = _declare(Setting(
    "RLK_NIGHTLY_WORKERS_PER_GPU", parse_positive_int_or_auto, "auto",
    "xdist workers the GPU nightly job runs on each GPU (`-n auto --rlk-shard-gpus "
    "--rlk-workers-per-gpu K --dist=worksteal`; benchmarks and `exclusive_gpu` tests still run alone "
    "afterwards); `auto`: one per 20 GB of GPU memory, at most one per two CPU cores (4 on an H100, 7 "
    "on an H200: `pytest_rlk.sharding.nightly_workers_per_gpu`); 1, or an `-n` among the job's "
    "arguments, runs pytest as given.",
    readers=(".ci/gpu-nightly",), read="when used", group="suite"))
FAKE_GPUS = _declare(Setting(
    "RLK_FAKE_GPUS", parse_positive_int, None,
    "A test seam for machines without GPUs: `--rlk-shard-gpus` shards over this many fake GPU ids "
    "(`0`..`N-1`) while the platform stays `cpu`; refused on a machine with GPUs.",
    readers=("pytest_rlk/sharding.py",), read="when used", group="suite"))
DATA = _declare(Setting(
    "RLK_DATA", parse_path, None,
    "Folder of the e2e data sets; A/B specs refer to it as `${RLK_DATA}`.",
    readers=("pytest_rlk/e2e/placeholders.py",), read="when used", group="suite"))
MODELS = _declare(Setting(
    "RLK_MODELS", parse_path, None,
    "Folder of the e2e model checkpoints; A/B specs refer to it as `${RLK_MODELS}`.",
    readers=("pytest_rlk/e2e/placeholders.py",), read="when used", group="suite"))
FAULT = _declare(Setting(
    "RLK_FAULT", parse_text, None,
    "The fault `pytest_rlk.prove.faults:make_backend` builds, as `NAME=SIZE` (`rlk prove` and "
    "`tools/e2e_power.py` set it for the runs they inject into; a spawned process reads it).",
    readers=("pytest_rlk/prove/faults.py", "pytest_rlk/prove/inject.py (sets it)"),
    read="when used", group="suite"))
GROUPS = ("kernels", "suite", "third party")


@dataclass(frozen=True)
class Effective:
    """What a setting is now: its value (or why it is invalid), its default and where it came from."""

    name: str
    value: str
    default: str
    source: str


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "(none)"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, frozenset):
        return ",".join(sorted(value))
    if isinstance(value, TileConfig):
        return ",".join(str(v) for v in (value.block_t, value.block_v, value.block_k, value.num_warps,
                                         value.num_stages))
    return str(value)


def effective() -> list[Effective]:
    """Every setting's effective value, default and source, in declaration order."""
    rows = []
    for setting in SETTINGS.values():
        source = setting.source()
        try:
            value = _shown(setting._parse_raw(setting.raw()))
        except ValueError as exc:
            value, source = f"INVALID ({exc})", "environment"
        rows.append(Effective(setting.name, value, _shown(setting.default), source))
    return rows


def _default_cell(setting: Setting[Any]) -> str:
    shown = _shown(setting.default)
    return "unset" if setting.default in (None, "") else f"`{shown}`"


def render_markdown() -> str:
    """docs/settings.md: every setting, grouped, as a table (``rlk env --markdown``)."""
    lines = [
        "# Settings (environment variables)",
        "",
        "<!-- generated from kernels/settings.py by `rlk env --markdown`; do not edit by hand -->",
        "",
        ("Every environment variable pytest-rlk reads, declared once in `kernels/settings.py`. "
         "`rlk env` prints each one's effective value, default and source. A flag takes "
         f"`{'/'.join(TRUE_WORDS)}` or `{'/'.join(FALSE_WORDS)}`; unset or blank means the default; any "
         "other value is an error naming the variable. *Read*: `every call` takes effect at the next "
         "call, `at import` is fixed for the process, `when used` is read where it is needed."),
    ]
    for group in GROUPS:
        lines += ["", f"## {group.capitalize()}", "", "| variable | type | default | read | what it does | read by |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for setting in SETTINGS.values():
            if setting.group != group:
                continue
            readers = ", ".join(f"`{r}`" if " " not in r else f"`{r.split(' ', 1)[0]}` {r.split(' ', 1)[1]}"
                                for r in setting.readers)
            lines.append(f"| `{setting.name}` | {setting.type_name} | {_default_cell(setting)} | {setting.read} | "
                         f"{setting.help} | {readers} |")
    return "\n".join(lines) + "\n"


__all__ = ["SETTINGS", "Effective", "Setting", "TileConfig", "effective", "render_markdown"]
