"""Ranks and DeepSpeed: everything that knows the model is sharded.

Process groups and collectives (``process_group``), the DeepSpeed ZeRO engine and its optimizer
(``deepspeed_engine``), bucketed ZeRO-3 gathers (``flat_gather``), the policy's teacher-forced
forward (``policy``), gradient accumulation over micro-batches (``accumulation``), PEFT LoRA
(``lora``) and parameter naming (``names``). See docs/distributed.md.

May import: ``stapo.losses`` and the folders below it (docs/index.md, "Layout"); never the
trainer, the weight sync or telemetry above it.
"""
