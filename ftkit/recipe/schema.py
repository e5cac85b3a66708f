"""The recipe's fields: name, type, default and one line of documentation, declared once.

Everything that describes a recipe field (the loader's type checks, ``ftkit init``'s comments, the generated
reference in docs/recipe.md, ``ftkit schema``'s JSON Schema) reads this table, so they cannot drift apart.

Types are small strings rather than Python annotations so they print well in errors and docs:
``int``, ``float``, ``bool``, ``str``, ``path``, ``host`` (a host name or an IP literal), ``list[str]`` (at least one
item; a ``pattern`` applies to every item), ``choice`` (with ``choices``), ``list[choice]`` (a list, possibly empty, of
``choices``), and unions such as ``int|auto`` or ``path|null``. ``path`` values are relative to the recipe
file's directory when they come from the file and to the current directory when they come from the command line.
Floats must be finite. Text that ends up on command lines (and, through the engines, in remote shells) has a
grammar: ``host`` values, and ``str`` values with a ``pattern``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

Value: TypeAlias = str | int | float | bool | list[str] | None  # a field's value, once the loader checked its type


class RequiredDefault:
    """The type of :data:`REQUIRED`: a field without a default."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = RequiredDefault()  # sentinel: the field has no default and must be given
Default: TypeAlias = Value | RequiredDefault  # what a field declares as its default


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    default: Default
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # inclusive lower bound for numbers
    exclusive_minimum: float | None = None  # strict lower bound for numbers (e.g. > 0)
    maximum: float | None = None  # inclusive upper bound for numbers
    exclusive_maximum: float | None = None  # strict upper bound for numbers (e.g. < 1)
    pattern: str | None = None  # regular expression a text value must match in full
    pattern_doc: str | None = None  # the pattern in words, for the error message

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def default_value(self) -> Value:
        """The default as a value of its own (a list is copied); None for a required field."""
        d = self.default
        if isinstance(d, RequiredDefault):
            return None
        return list(d) if isinstance(d, list) else d

    def type_label(self) -> str:
        labels = {"choice": ", ".join(self.choices), "list[choice]": f"list of {', '.join(self.choices)}"}
        return " or ".join(labels.get(k, k) for k in self.type.split("|"))


@dataclass(frozen=True)
class Section:
    name: str
    doc: str
    fields: tuple[Field, ...]
    optional: bool = False  # the whole section may be absent (peft: absent means full fine-tuning)

    def get(self, key: str) -> Field | None:
        for f in self.fields:
            if f.name == key:
                return f
        return None

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]


_f = Field  # the table below reads as name, type, default, doc, then the bounds by name

HF_SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")  # HF Trainer's, as lr_scheduler_type
# DeepSpeed's own (deepspeed/runtime/lr_schedules.py), rendered as ds_config.json's scheduler block
DEEPSPEED_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


TOP_LEVEL = (
    _f(
        "name",
        "str",
        "ftkit-run",
        "Run name, used in logs and the rendezvous id: letters, digits, '.', '_', '-', at most 64.",
        pattern=r"[A-Za-z0-9._-]{1,64}",
        pattern_doc="must be 1 to 64 letters, digits, '.', '_' or '-' (it becomes the rendezvous id)",
    ),
)

SECTIONS: tuple[Section, ...] = (
    Section(
        "model",
        "The model to fine-tune.",
        (
            _f(
                "path",
                "path",
                REQUIRED,
                "Local model directory with config.json, or a hub id org/name (config.json through the hub cache).",
            ),
            _f(
                "revision",
                "str|null",
                None,
                "Hub branch, tag or commit of a hub id (pin a commit for reproducible configs); null: main.",
                pattern=r"[A-Za-z0-9][A-Za-z0-9._/+-]{0,254}",
                pattern_doc="must be a branch, tag or commit: letters, digits, '.', '_', '/', '+', '-'",
            ),
            _f(
                "config",
                "path|null",
                None,
                "Checked-in copy of the model's config.json that plan/render/check read instead (CI without network).",
            ),
            _f("tokenizer", "path|null", None, "Tokenizer directory or hub id; null: the model's."),
            _f(
                "gradient_checkpointing",
                "bool",
                False,
                "Recompute activations in the backward pass: less memory, about 30% more compute.",
            ),
        ),
    ),
    Section(
        "peft",
        "Parameter-efficient fine-tuning; omit the whole section for full fine-tuning.",
        (
            _f("method", "choice", "lora", "PEFT method.", choices=("lora",)),
            _f("r", "int", 16, "LoRA rank.", exclusive_minimum=0),
            _f("alpha", "float", 32, "LoRA scaling numerator (scale = alpha / r).", exclusive_minimum=0),
            _f("dropout", "float", 0.05, "Dropout on the LoRA input, 0 to 1.", minimum=0, maximum=1),
            _f(
                "target_modules",
                "list[str]",
                ["q_proj", "v_proj"],
                "Names of the Linear modules that get adapters (e.g. q_proj, k_proj, v_proj, o_proj).",
            ),
        ),
        optional=True,
    ),
    Section(
        "data",
        "Training data from local files.",
        (
            _f(
                "train",
                "path",
                REQUIRED,
                "Training file: jsonl/json/csv/parquet/txt with fields text | prompt+completion | messages.",
            ),
            _f("max_seq_len", "int", 512, "Longest example in tokens.", exclusive_minimum=0),
            _f(
                "truncate",
                "bool",
                False,
                "Cut examples longer than max_seq_len instead of failing with the row number.",
            ),
            _f(
                "eval",
                "path|null",
                None,
                "Evaluation file in the same formats as train; its loss is logged every train.eval_steps; null: none.",
            ),
        ),
    ),
    Section(
        "train",
        "The HF Trainer run.",
        (
            _f(
                "output_dir",
                "path",
                REQUIRED,
                "Run directory: checkpoints, logs, events.jsonl, rendered configs, final model.",
            ),
            _f(
                "backend",
                "choice",
                "deepspeed",
                "How the ranks shard the model: deepspeed (ZeRO, the zero section; ds_config.json and a DEEPSPEED "
                "accelerate.yaml) or fsdp2 (PyTorch FSDP2 through Accelerate, the fsdp section; an FSDP "
                "accelerate.yaml with fsdp_version 2, no ds_config.json); auto: the fastest candidate that fits "
                "across both, per ftkit plan (zero.* and fsdp.* the recipe sets narrow each side; runs under "
                "accelerate).",
                choices=("deepspeed", "fsdp2", "auto"),
            ),
            _f(
                "precision",
                "choice",
                "bf16",
                "Mixed precision; bf16 needs Ampere or newer GPUs.",
                choices=("bf16", "fp16", "fp32"),
            ),
            _f(
                "fp16_loss_scale",
                "float|auto",
                "auto",
                "fp16 only: a static loss scale, or 0 for dynamic loss scaling; auto: 0 (dynamic).",
                minimum=0,
            ),
            _f(
                "fp16_initial_scale_power",
                "int|auto",
                "auto",
                "fp16 only: dynamic loss scaling starts at 2^this; auto: 16.",
                minimum=0,
            ),
            _f(
                "fp16_loss_scale_window",
                "int|auto",
                "auto",
                "fp16 only: optimizer steps without an overflow before the loss scale doubles; auto: 1000.",
                exclusive_minimum=0,
            ),
            _f(
                "fp16_hysteresis",
                "int|auto",
                "auto",
                "fp16 only: overflows in a row tolerated before the loss scale is halved; auto: 2.",
                exclusive_minimum=0,
            ),
            _f(
                "fp16_min_loss_scale",
                "float|auto",
                "auto",
                "fp16 only: the dynamic loss scale never goes below this; auto: 1.",
                exclusive_minimum=0,
            ),
            _f("micro_batch_size", "int", 4, "Examples per process per forward pass.", exclusive_minimum=0),
            _f(
                "global_batch_size",
                "int",
                16,
                "Examples per optimizer step = micro_batch_size x grad accumulation x world size (must divide).",
                exclusive_minimum=0,
            ),
            _f("max_steps", "int|null", 100, "Optimizer steps to train; null: use epochs.", exclusive_minimum=0),
            _f("epochs", "float|null", None, "Passes over the data when max_steps is null.", exclusive_minimum=0),
            _f("learning_rate", "float", 2.0e-4, "Peak learning rate (AdamW).", exclusive_minimum=0),
            _f(
                "lr_scheduler",
                "choice",
                "cosine",
                "Learning-rate schedule: HF's linear, cosine, constant, constant_with_warmup (after a linear warm-up), "
                "or DeepSpeed's own WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest (rendered into "
                "ds_config.json with the scheduler section; train.backend deepspeed).",
                choices=HF_SCHEDULES + DEEPSPEED_SCHEDULES,
            ),
            _f(
                "warmup_steps",
                "int",
                0,
                "Warm-up steps (DeepSpeed's warmup_num_steps, at least 1 there; its curve: scheduler.warmup_type).",
                minimum=0,
            ),
            _f("weight_decay", "float", 0.0, "AdamW weight decay.", minimum=0),
            _f("adam_beta1", "float", 0.9, "AdamW beta1, 0 to below 1.", minimum=0, exclusive_maximum=1),
            _f("adam_beta2", "float", 0.999, "AdamW beta2, 0 to below 1.", minimum=0, exclusive_maximum=1),
            _f("adam_epsilon", "float", 1.0e-8, "AdamW epsilon.", exclusive_minimum=0),
            _f("max_grad_norm", "float", 1.0, "Gradient clipping norm (DeepSpeed gradient_clipping).", minimum=0),
            _f("logging_steps", "int", 10, "Log the loss every N optimizer steps.", exclusive_minimum=0),
            _f("save_steps", "int", 20, "Save (and commit) a checkpoint every N optimizer steps.", exclusive_minimum=0),
            _f(
                "save_total_limit",
                "int",
                3,
                "Committed checkpoints to keep; the newest committed one is never deleted.",
                exclusive_minimum=0,
            ),
            _f(
                "seed",
                "int",
                42,
                "Random seed for weights of new layers, data order and dropout.",
                minimum=0,
                maximum=2**32 - 1,
            ),
            _f(
                "eval_steps",
                "int|null",
                None,
                "Evaluate on data.eval every N optimizer steps; null: every save_steps.",
                exclusive_minimum=0,
            ),
            _f(
                "report_to",
                "list[choice]",
                [],
                "Where HF Trainer also reports metrics: tensorboard (event files in <output_dir>/tensorboard, "
                "offline), wandb, mlflow (when installed); []: nowhere but ftkit's metrics.jsonl.",
                choices=("tensorboard", "wandb", "mlflow", "none"),
            ),
            _f(
                "command",
                "list[str]|null",
                None,
                "Your training command run on every rank instead of the built-in entry, one word per item "
                "(e.g. [python, sft.py, --bf16]); `ftkit launch RECIPE -- CMD` overrides it; null: the built-in entry.",
                pattern=r"[^\x00-\x1f\x7f]*",
                pattern_doc="must be printable text without control characters (newline, tab, NUL)",
            ),
        ),
    ),
    Section(
        "scheduler",
        "DeepSpeed's own learning-rate schedules (train.lr_scheduler WarmupLR, WarmupDecayLR, WarmupCosineLR, "
        "OneCycle, LRRangeTest), beyond train.learning_rate (the peak), train.warmup_steps and train.max_steps (the "
        "length); HF's schedules ignore this section.",
        (
            _f(
                "warmup_type",
                "choice",
                "log",
                "WarmupLR, WarmupDecayLR, WarmupCosineLR: the warm-up curve, log (DeepSpeed's default) or linear.",
                choices=("log", "linear"),
            ),
            _f(
                "warmup_min_lr",
                "float",
                0.0,
                "WarmupLR, WarmupDecayLR: the learning rate the warm-up starts from.",
                minimum=0,
            ),
            _f(
                "warmup_min_ratio",
                "float",
                0.0,
                "WarmupCosineLR: the warm-up starts at this fraction of train.learning_rate.",
                minimum=0,
            ),
            _f(
                "cos_min_ratio",
                "float",
                0.0001,
                "WarmupCosineLR: the cosine decay ends at this fraction of train.learning_rate.",
                minimum=0,
            ),
            _f(
                "cycle_min_lr",
                "float|null",
                None,
                "OneCycle (required there): the learning rate at both ends of the cycle.",
                minimum=0,
            ),
            _f(
                "cycle_max_lr",
                "float|null",
                None,
                "OneCycle (required there): the learning rate at the top of the cycle.",
                minimum=0,
            ),
            _f(
                "cycle_first_step_size",
                "int",
                2000,
                "OneCycle: optimizer steps from cycle_min_lr up to cycle_max_lr.",
                exclusive_minimum=0,
            ),
            _f(
                "cycle_second_step_size",
                "int|null",
                None,
                "OneCycle: steps back down to cycle_min_lr; null: cycle_first_step_size.",
                minimum=0,
            ),
            _f(
                "cycle_first_stair_count",
                "int",
                0,
                "OneCycle: stairs on the way up; 0: a smooth ramp.",
                minimum=0,
            ),
            _f(
                "cycle_second_stair_count",
                "int|null",
                None,
                "OneCycle: stairs on the way down; null: cycle_first_stair_count.",
                minimum=0,
            ),
            _f(
                "decay_lr_rate",
                "float",
                0.0,
                "OneCycle: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate x steps / decay_step_size).",
                minimum=0,
            ),
            _f(
                "decay_step_size",
                "int",
                0,
                "OneCycle: steps per decay interval after the cycle; 0: no decay.",
                minimum=0,
            ),
            _f(
                "cycle_momentum",
                "bool",
                True,
                "OneCycle: cycle AdamW's beta1 too, from cycle_max_mom down to cycle_min_mom and back.",
            ),
            _f("cycle_min_mom", "float", 0.8, "OneCycle: beta1 at the top of the cycle.", minimum=0),
            _f("cycle_max_mom", "float", 0.9, "OneCycle: beta1 at both ends of the cycle.", minimum=0),
            _f("decay_mom_rate", "float", 0.0, "OneCycle: beta1's decay rate after the cycle.", minimum=0),
            _f(
                "lr_range_test_min_lr",
                "float",
                0.001,
                "LRRangeTest: the learning rate at step 0.",
                minimum=0,
            ),
            _f(
                "lr_range_test_step_size",
                "int",
                2000,
                "LRRangeTest: optimizer steps per interval; lr = lr_range_test_min_lr x (1 + step_rate x intervals).",
                exclusive_minimum=0,
            ),
            _f(
                "lr_range_test_step_rate",
                "float",
                1.0,
                "LRRangeTest: the growth per interval, in multiples of lr_range_test_min_lr.",
                minimum=0,
            ),
            _f(
                "lr_range_test_staircase",
                "bool",
                False,
                "LRRangeTest: grow in whole intervals (stairs) instead of continuously.",
            ),
        ),
    ),
    Section(
        "checkpoint",
        "Checkpoint tiers: a node-local tier saved often, copied to the run directory in the background.",
        (
            _f(
                "local_dir",
                "path|auto|null",
                "auto",
                "Node-local directory for frequent checkpoints (a RAM disk such as /dev/shm, or local NVMe; {host} is "
                "replaced by the node's name); auto: a directory under /dev/shm when the plan shows the tier fits in "
                "host memory with headroom, else off; null: off (every save goes to the run directory).",
            ),
            _f(
                "local_steps",
                "int|auto",
                "auto",
                "Save to the local tier every N optimizer steps; auto: the Young/Daly interval sqrt(2 x save cost x "
                "MTBF) from the save cost ftkit measured (or estimates) and resilience.mtbf_hours, at most "
                "train.save_steps. train.save_steps stays the cadence of the copies to the run directory.",
                minimum=1,
            ),
            _f(
                "local_keep",
                "int",
                2,
                "Committed checkpoints each node keeps in the local tier (the newest; one still being copied to the "
                "run directory is kept as well).",
                minimum=1,
            ),
            _f(
                "peer_copies",
                "int",
                0,
                "1: each node's committed local part is also copied to the next node's local tier, so losing a node "
                "still leaves the newest complete checkpoint; 0: no peer copies.",
                minimum=0,
                maximum=1,
            ),
        ),
    ),
    Section(
        "zero",
        "DeepSpeed ZeRO sharding.",
        (
            _f(
                "stage",
                "int|auto",
                2,
                "ZeRO stage 0-3; auto: the fastest that fits per ftkit plan.",
                minimum=0,
                maximum=3,
            ),
            _f(
                "offload_optimizer",
                "choice",
                "none",
                "Where optimizer states live; auto: decided with the stage by ftkit plan.",
                choices=("none", "cpu", "nvme", "auto"),
            ),
            _f(
                "offload_params",
                "choice",
                "none",
                "Where parameters live (stage 3 only).",
                choices=("none", "cpu", "nvme"),
            ),
            _f("nvme_path", "path|null", None, "Local NVMe directory for nvme offload (required with nvme)."),
            _f(
                "cpu_adam",
                "bool|auto",
                "auto",
                "With optimizer offload, the optimizer that steps on the CPU: true: DeepSpeed's CPU Adam (fastest; "
                "a just-in-time build with a C++ compiler, and nvcc on a CUDA host, unless DeepSpeed was installed "
                "with it prebuilt); false: torch's AdamW (nothing to compile, a slower step); auto: CPU Adam where "
                "every host has it prebuilt or can build it (checked before any rank starts), else torch's AdamW.",
            ),
            _f(
                "overlap_comm",
                "bool|auto",
                "auto",
                "Overlap gradient reduction with backward; auto: on at stage 3, at 1/2 when memory allows.",
            ),
            _f(
                "reduce_bucket_size",
                "int|auto",
                "auto",
                "Elements per gradient-reduction bucket; auto: hidden_size^2.",
                exclusive_minimum=0,
            ),
            _f(
                "allgather_bucket_size",
                "int|auto",
                "auto",
                "Elements per all-gather bucket at stage 1/2; auto: 5e8, less when memory is tight.",
                exclusive_minimum=0,
            ),
            _f(
                "contiguous_gradients",
                "bool|auto",
                "auto",
                "Copy gradients into one contiguous buffer as they are produced (less fragmentation); auto: on.",
            ),
            _f(
                "round_robin_gradients",
                "bool|auto",
                "auto",
                "Stage 1/2: spread the gradient copies to the CPU over ranks in turn; auto: on only with optimizer "
                "offload.",
            ),
            _f(
                "pin_memory",
                "bool|auto",
                "auto",
                "Page-locked host buffers for offload (faster copies; host RAM that cannot be paged out); auto: on "
                "unless the accelerator is cpu or host RAM is tight.",
            ),
            _f(
                "sub_group_size",
                "int|auto",
                "auto",
                "Stage 3: parameters (elements) per optimizer-step sub-group; auto: 1e9.",
                minimum=0,
            ),
            _f(
                "prefetch_bucket_size",
                "int|auto",
                "auto",
                "Stage 3: parameters (elements) fetched ahead of use (stage3_prefetch_bucket_size); auto: "
                "int(0.9 x hidden_size^2).",
                minimum=0,
            ),
            _f(
                "param_persistence_threshold",
                "int|auto",
                "auto",
                "Stage 3: parameters with fewer elements than this stay gathered (stage3_param_persistence_threshold); "
                "auto: 10 x hidden_size.",
                minimum=0,
            ),
            _f(
                "max_live_parameters",
                "int|auto",
                "auto",
                "Stage 3: most parameters (elements) gathered at once (stage3_max_live_parameters); auto: 1e9, 1e8 "
                "when memory is tight.",
                minimum=0,
            ),
            _f(
                "max_reuse_distance",
                "int|auto",
                "auto",
                "Stage 3: a gathered parameter used again within this many parameters stays gathered "
                "(stage3_max_reuse_distance); auto: 1e9, 1e8 when memory is tight.",
                minimum=0,
            ),
        ),
    ),
    Section(
        "fsdp",
        "PyTorch FSDP2 sharding (train.backend: fsdp2). Parameters, gradients and optimizer states are always "
        "sharded across all ranks; model.gradient_checkpointing becomes FSDP's activation checkpointing.",
        (
            _f(
                "reshard_after_forward",
                "bool",
                True,
                "Free each wrapped layer's gathered parameters after its forward and gather them again for backward "
                "(ZeRO-3's memory); false keeps them gathered until backward (about ZeRO-2's memory, one all-gather "
                "less per step).",
            ),
            _f(
                "offload_params",
                "bool",
                False,
                "Keep parameters, gradients and optimizer states in host memory and step the optimizer there "
                "(FSDP2's CPU offload; cuda only).",
            ),
            _f(
                "transformer_layer_cls",
                "str|auto",
                "auto",
                "The decoder layer class each FSDP unit wraps (comma-separated for several); auto: from config.json's "
                "architectures (LlamaForCausalLM -> LlamaDecoderLayer).",
                pattern=r"[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*",
                pattern_doc="must be Python class names separated by commas",
            ),
            _f(
                "state_dict_type",
                "choice",
                "sharded",
                "Checkpoints: sharded (torch.distributed.checkpoint shards written by every rank, resharded on load "
                "to another world size) or full (one state dict gathered on rank 0). The final model is always "
                "saved whole, in Hugging Face format.",
                choices=("sharded", "full"),
            ),
            _f(
                "cpu_ram_efficient_loading",
                "bool",
                True,
                "Rank 0 alone reads the pretrained weights and broadcasts them; the other ranks start on the meta "
                "device (host memory for one copy of the model per node, not one per rank).",
            ),
        ),
    ),
    Section(
        "parallel",
        "Tensor and sequence parallelism inside a node, on top of the data parallelism of zero or fsdp; the "
        "data-parallel degree is what is left: world size / (tp x sp), and it alone multiplies the micro batch. "
        "Omit the section (tp: 1, sp: 1) to train data-parallel only.",
        (
            _f(
                "tp",
                "int|auto",
                1,
                "Tensor-parallel degree: ranks of one node that split every layer's weights and activations "
                "(DeepSpeed AutoTP under train.backend deepspeed, which ftkit launch runs for its built-in entry and "
                "a script alike; Accelerate's tp_size under fsdp2, rendered for a launcher of your own); must divide "
                "the attention and key-value heads and cluster.gpus_per_node; auto: 1 unless ftkit plan finds "
                "data parallelism alone does not fit or is slower.",
                minimum=1,
            ),
            _f(
                "sp",
                "int|auto",
                1,
                "Sequence-parallel degree (DeepSpeed ALST/Ulysses, Accelerate sp_backend deepspeed; train.backend "
                "deepspeed): ranks of one node that split every sequence, with two all-to-alls per attention "
                "layer; must divide the attention heads, cluster.gpus_per_node and data.max_seq_len; needs sdpa or "
                "flash attention; ftkit launch runs it with its built-in entry (a script of your own builds the "
                "parallelism config itself); auto: 1 unless ftkit plan finds data parallelism alone does not fit or "
                "is slower.",
                minimum=1,
            ),
        ),
    ),
    Section(
        "cluster",
        "Where the job runs.",
        (
            _f("hostfile", "path|null", None, "DeepSpeed-style hostfile (host slots=N); null: this machine only."),
            _f(
                "num_nodes",
                "int",
                1,
                "Nodes (ignored when a hostfile is given: it counts the hosts).",
                exclusive_minimum=0,
            ),
            _f(
                "gpus_per_node",
                "int",
                8,
                "Processes per node (CPU ranks when accelerator is cpu); a hostfile's slots override it.",
                exclusive_minimum=0,
            ),
            _f(
                "gpu_memory_gb",
                "float",
                80,
                "Memory per GPU in GiB (per CPU rank when accelerator is cpu), for ftkit plan.",
                exclusive_minimum=0,
            ),
            _f("host_memory_gb", "float", 256, "Host RAM per node in GiB, for offload planning.", exclusive_minimum=0),
            _f(
                "accelerator",
                "choice",
                "cuda",
                "cuda, or cpu (DS_ACCELERATOR=cpu and gloo, for tests and demos).",
                choices=("cuda", "cpu"),
            ),
            _f(
                "engine",
                "choice",
                "deepspeed",
                "Launcher: the deepspeed runner (pdsh/ssh), accelerate launch, torchrun (c10d), or slurm (srun "
                "inside an allocation: hosts from it, no ssh, no hostfile; start it with ftkit submit); auto: slurm "
                "when SLURM_JOB_ID is set, else deepspeed (the plan prints which).",
                choices=("deepspeed", "accelerate", "torchrun", "slurm", "auto"),
            ),
            _f(
                "master_addr",
                "host|null",
                None,
                "Address of rank 0, a host name or IP address; null: the first host (127.0.0.1 when local).",
            ),
            _f("ssh_config", "path|null", None, "ssh client config passed as -F to ssh and pdsh; null: ~/.ssh/config."),
            _f(
                "env",
                "list[str]|null",
                None,
                "Environment for the ranks on other hosts, besides ftkit's allow-list: NAME forwards this machine's "
                "value, NAME=VALUE sets one (ranks on this machine get its whole environment, as torchrun does); "
                "secrets stay redacted wherever an environment is printed or recorded.",
                pattern=r"[A-Za-z_][A-Za-z0-9_]*(=.*)?",
                pattern_doc="must be NAME or NAME=VALUE (NAME: letters, digits, _)",
            ),
            _f(
                "master_port",
                "int",
                29500,
                "TCP port for the rendezvous on the master host, 1-65535.",
                minimum=1,
                maximum=65535,
            ),
            _f(
                "min_nodes",
                "int|null",
                None,
                "Fewest nodes to continue on after losing hosts; null: all nodes.",
                minimum=1,
            ),
            _f(
                "gpu",
                "choice",
                "auto",
                "GPU model for ftkit plan's step time (peak TFLOP/s); auto: guessed from gpu_memory_gb.",
                choices=("auto", "h100", "h100-pcie", "h200", "a100", "a100-40", "l40s", "a10", "l4", "v100", "cpu"),
            ),
            _f(
                "network",
                "choice",
                "auto",
                "Links for ftkit plan's step time: intra-node + inter-node preset; auto: nvlink-ib400 (cpu: loopback).",
                choices=("auto", "nvlink-ib400", "nvlink-ib200", "nvlink-eth100", "pcie-ib100", "pcie-eth25", "eth10"),
            ),
            _f(
                "intra_node_gbs",
                "float|null",
                None,
                "Intra-node bus bandwidth in GB/s per GPU (overrides the network preset); null: the preset's.",
                exclusive_minimum=0,
            ),
            _f(
                "inter_node_gbs",
                "float|null",
                None,
                "Inter-node bandwidth in GB/s per node, all NICs (overrides the network preset); null: the preset's.",
                exclusive_minimum=0,
            ),
        ),
    ),
    Section(
        "resilience",
        "Supervision and restarts.",
        (
            _f("max_restarts", "int", 3, "Restarts allowed for the whole job (one per incident).", minimum=0),
            _f(
                "hang_timeout_s",
                "float",
                600,
                "Seconds without a step before the run counts as hung.",
                exclusive_minimum=0,
            ),
            _f(
                "startup_timeout_s",
                "float",
                900,
                "Seconds from launch to the first step before the start counts as hung.",
                exclusive_minimum=0,
            ),
            _f("backoff_s", "float", 10, "First wait before a restart; doubles each time, with jitter.", minimum=0),
            _f("backoff_max_s", "float", 300, "Longest wait between restarts.", minimum=0),
            _f(
                "stop_timeout_s",
                "float",
                120,
                "Seconds a graceful stop (first SIGTERM/SIGINT, ftkit stop) waits for the save at the next step "
                "boundary before tearing down; one optimizer step plus one checkpoint save must fit (120 covers a "
                "multi-GB sharded save on local NVMe).",
                exclusive_minimum=0,
            ),
            _f(
                "mtbf_hours",
                "float",
                24,
                "Mean time between failures of the whole job, in hours, for checkpoint.local_steps: auto (Young/Daly).",
                exclusive_minimum=0,
            ),
            _f(
                "max_requeues",
                "int",
                3,
                "Slurm requeues after a time-limit or preemption notice (ftkit submit; counted from "
                "SLURM_RESTART_COUNT): each saves the step in flight and resumes from it; spent: exit 8, the job ends.",
                minimum=0,
            ),
            _f(
                "exclude_stragglers",
                "bool",
                False,
                "Restart without a host whose ranks are consistently slower than the rest (ftkit status names it), "
                "when cluster.min_nodes allows.",
            ),
            _f(
                "orphan_timeout_s",
                "float",
                60,
                "Seconds a rank trains on without its supervisor (ftkit launch killed, terminal closed) before it "
                "stops itself; 60 leaves room for a --takeover.",
                exclusive_minimum=0,
            ),
            _f(
                "resume_tolerance",
                "float",
                0.01,
                "Relative difference allowed between a recomputed step's loss or grad norm and the value logged "
                "before the restart (GPU kernels are not bit-exact; CPU runs match exactly); 10x it stops the run.",
                minimum=0,
            ),
            _f(
                "checksum",
                "choice",
                "full",
                "How each checkpoint file is checksummed at save: full (every byte, XXH3-128, several GB/s per "
                "core) or sampled (about 1.1 MiB of each file over 8 MiB: only for checkpoints too large to read "
                "once per save; misses a flipped block between samples).",
                choices=("full", "sampled"),
            ),
            _f(
                "verify_checksums",
                "bool",
                True,
                "Before resuming, re-read every file of each checkpoint considered against its checksum (false: "
                "sizes only, a faster restart that misses same-size corruption).",
            ),
        ),
    ),
)

SECTION_BY_NAME = {s.name: s for s in SECTIONS}


def all_fields() -> list[tuple[str, Field]]:
    """Every field as (dotted key, Field), in declaration order."""
    out = [(f.name, f) for f in TOP_LEVEL]
    for s in SECTIONS:
        out.extend((f"{s.name}.{f.name}", f) for f in s.fields)
    return out


FIELD_BY_KEY: dict[str, Field] = dict(all_fields())
