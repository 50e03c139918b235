"""python -m fastzero.ops: which backends this machine has, and why any is missing."""

from fastzero.ops.backend import report

print(report())
