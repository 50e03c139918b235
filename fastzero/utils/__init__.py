"""Helpers under DeepSpeed's ``deepspeed.utils`` names, for scripts that
import them: :mod:`fastzero.utils.zero_to_fp32`."""
