"""The messages between the trainer, the sandbox's launcher and its worker: length-prefixed JSON.

A reader that does not trust its writer caps the length before reading and type-checks every field, so a
forged answer ends its sandbox with a reason, never an exception (docs/tools.md, "Threat model").
"""

import json
import os

READY_CAP = 1 << 16  # the worker's {"ready": true, "isolation": {...}}


def cell_cap(max_output_chars: int) -> int:
    """Bytes a cell's answer may take: its ``tail`` of at most max_output_chars characters at 12 bytes
    each (JSON's escape of a surrogate pair), plus 4 KiB for the rest."""
    return 12 * max_output_chars + 4096


def write_frame(fd: int, message: dict) -> None:
    data = json.dumps(message).encode()
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd: int):
    """The next message on a blocking ``fd`` from a trusted writer; None at end of file."""
    head = _read_exactly(fd, 4)
    body = _read_exactly(fd, int.from_bytes(head, "big")) if head is not None else None
    return None if body is None else json.loads(body)


def _read_exactly(fd: int, size: int):
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def take_frame(buffer: bytearray, cap: int):
    """The next message in ``buffer`` (removed from it); None while it is incomplete; ``{}`` when its
    length is over ``cap`` or its body is not a JSON object (so that every check of its fields fails)."""
    if len(buffer) < 4:
        return None
    size = int.from_bytes(buffer[:4], "big")
    if size > cap:
        return {}
    if len(buffer) < 4 + size:
        return None
    body = bytes(buffer[4:4 + size])
    del buffer[:4 + size]
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def cell_result(message: dict, max_output_chars: int, number=None):
    """``(error, cut, tail)`` of a cell's answer, or None when a field is missing, of the wrong type
    (NaN is not an int) or out of range, or (with ``number``) it answers another cell."""
    if number is not None and not (type(message.get("k")) is int and message["k"] == number):
        return None
    error, cut, tail = message.get("error"), message.get("cut"), message.get("tail")
    if type(error) is bool and type(cut) is int and cut >= 0 and type(tail) is str and len(tail) <= max_output_chars:
        return error, cut, tail
    return None
