"""Checkpoints on disk, the same for the supervisor and the ranks: what a checkpoint holds, how a save is committed and
verified, and the tiers it lives in.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.checksums`: Checksums of checkpoint files, as commit records name them: ``algorithm:hex``.
* :mod:`.commit`: Committing a save: every rank's manifest part (size and a checksum of every byte it wrote,
  fsynced), and rank 0's commit record, written atomically only when the parts cover the whole directory and the
  layout is sound.
* :mod:`.directory`: The checkpoints of one output directory: which are ftkit's (a record that it began each save),
  the newest one that verifies (resume), rotation of old and torn ones (only ftkit's own), and setting newer torn
  ones aside so a resumed run can write that step again.
* :mod:`.layout`: What a checkpoint directory holds, by name: HF Trainer + DeepSpeed's (or FSDP2's DCP) files, which
  rank writes which, the commit record's name and format, DeepSpeed's ``latest`` tag, and the structural check of a
  checkpoint without a record.
* :mod:`.tiers`: Checkpoint tiers on disk: a node-local tier the ranks save to often, the run directory (durable)
  the copies go to.
* :mod:`.verify`: Whether a checkpoint can be resumed from: its commit record parses, every listed file exists with
  its size and (by default) its checksum, and it was saved with this launch's world size and ZeRO stage; or, without
  a record, its structure (for runs ftkit did not write).
"""

__all__ = ["checksums", "commit", "directory", "layout", "tiers", "verify"]
