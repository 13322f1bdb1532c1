"""TensorBoard event files as a second metric source (vime writes them with `--use-tensorboard`
into `TENSORBOARD_DIR`). The `tensorboard` package is not needed: this is a minimal reader of
the two formats involved:

- TFRecord framing: uint64 length, uint32 masked CRC-32C of the length, data, uint32 masked
  CRC-32C of the data (little endian). A truncated last record (a run killed mid-write) ends the
  file and is reported, not raised; a CRC mismatch is an error naming the file and offset.
- `tensorflow.Event` protobuf: wall_time (1, double), step (2, int64), summary (5) -> value (1)
  -> tag (1, string) and simple_value (2, float) or a scalar tensor (8: dtype 1, tensor_content
  4, float_val 5, double_val 6). Other fields are skipped by wire type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

_CRC_TABLE: list[int] = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


class TensorBoardError(ValueError):
    """A corrupt event file (names the file and byte offset)."""


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes):
    """Yield (field number, wire type, value) of one protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, wire, value


_DT_FLOAT, _DT_DOUBLE = 1, 2


def _tensor_scalar(buf: bytes) -> float | None:
    dtype, content, floats, doubles = None, b"", [], []
    for number, wire, value in _fields(buf):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 4 and wire == 2:
            content = value
        elif number == 5:
            floats += [struct.unpack("<f", value)[0]] if wire == 5 else list(struct.unpack(f"<{len(value) // 4}f", value))
        elif number == 6:
            doubles += [struct.unpack("<d", value)[0]] if wire == 1 else list(struct.unpack(f"<{len(value) // 8}d", value))
    if floats:
        return floats[0]
    if doubles:
        return doubles[0]
    if dtype == _DT_FLOAT and len(content) == 4:
        return struct.unpack("<f", content)[0]
    if dtype == _DT_DOUBLE and len(content) == 8:
        return struct.unpack("<d", content)[0]
    return None


def _event_scalars(buf: bytes) -> tuple[int, list[tuple[str, float]]]:
    step, out = 0, []
    for number, wire, value in _fields(buf):
        if number == 2 and wire == 0:
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 5 and wire == 2:
            for s_number, s_wire, s_value in _fields(value):
                if s_number != 1 or s_wire != 2:
                    continue
                tag, scalar = None, None
                for v_number, v_wire, v_value in _fields(s_value):
                    if v_number == 1 and v_wire == 2:
                        tag = v_value.decode("utf-8", errors="replace")
                    elif v_number == 2 and v_wire == 5:
                        scalar = struct.unpack("<f", v_value)[0]
                    elif v_number == 8 and v_wire == 2:
                        scalar = _tensor_scalar(v_value)
                if tag is not None and scalar is not None:
                    out.append((tag, scalar))
    return step, out


@dataclass
class TensorBoardScalars:
    """tag -> {step: value} from every event file under a directory."""

    scalars: dict[str, dict[int, float]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)


def read_event_file(path: Path, into: TensorBoardScalars) -> None:
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        if pos + 12 > len(data):
            into.truncated.append(f"{path}: truncated record header at byte {pos}")
            return
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if masked_crc(header) != header_crc:
            raise TensorBoardError(f"{path}: bad length CRC at byte {pos}")
        end = pos + 12 + length + 4
        if end > len(data):
            into.truncated.append(f"{path}: truncated record at byte {pos}")
            return
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length : end])
        if masked_crc(body) != body_crc:
            raise TensorBoardError(f"{path}: bad data CRC at byte {pos}")
        try:
            step, values = _event_scalars(body)
        except (ValueError, struct.error) as exc:
            raise TensorBoardError(f"{path}: undecodable event at byte {pos}: {exc}") from None
        for tag, value in values:
            into.scalars.setdefault(tag, {})[step] = value
        pos = end


def read_scalars(directory: str | Path) -> TensorBoardScalars:
    """All scalars of the event files (`*tfevents*`) under `directory`, recursively."""
    root = Path(directory)
    out = TensorBoardScalars()
    for path in sorted(root.rglob("*tfevents*")):
        if path.is_file():
            out.files.append(path)
            read_event_file(path, out)
    return out


def cross_check(stdout_records: dict[int, dict[str, float]], tb: TensorBoardScalars, *,
                rel: float = 1e-5) -> tuple[list[str], list[str]]:
    """Compare stdout metric dicts ({index: {key: value}}) with TensorBoard for the keys both have.

    Values are matched in order (stdout by index, TensorBoard by step), so the check does not
    depend on which step axis vime writes a key with. TensorBoard stores float32: compared with
    relative tolerance `rel`. Returns (disagreements, notes); a different number of values (a
    writer that had not flushed when a run died) is a note, not a disagreement.
    """
    problems: list[str] = []
    notes: list[str] = []
    keys = sorted({k for values in stdout_records.values() for k in values} & set(tb.scalars))
    for key in keys:
        ours = [(i, stdout_records[i][key]) for i in sorted(stdout_records) if key in stdout_records[i]]
        theirs = [tb.scalars[key][step] for step in sorted(tb.scalars[key])]
        if len(ours) != len(theirs):
            notes.append(f"{key}: {len(ours)} values on stdout, {len(theirs)} in TensorBoard")
        for (index, value), tb_value in zip(ours, theirs):
            if abs(tb_value - value) > rel * max(abs(value), 1e-6):
                problems.append(f"{key} at {index}: stdout {value!r} vs TensorBoard {tb_value!r}")
    return problems, notes
