"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing`` path (Megatron
scripts import the API from there): :mod:`.checkpointing` is
:mod:`fastzero.checkpointing`."""

from fastzero.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
