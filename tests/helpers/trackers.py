"""What the trackers wrote, read back without their servers: wandb's offline ``.wandb`` files."""

from __future__ import annotations

import struct
from pathlib import Path


def wandb_records(path: str):
    """The records of a ``.wandb`` file (LevelDB's log format: 32 KiB blocks of checksummed chunks, after wandb's
    7-byte header), as wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 2:
            pending = chunk
            continue
        if kind == 3:
            pending += chunk
            continue
        record = pb.Record()
        record.ParseFromString(pending + chunk if kind == 4 else chunk)
        pending = b""
        yield record
