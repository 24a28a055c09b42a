"""Per-op sharding rules: which strategies each ATen op admits on a mesh.

Two kinds of nodes:

* **anchors** get a variable per strategy in the ILP: parameters, inputs, ops with several tensor
  inputs (linear, embedding, attention, layer norm, losses, binary element-wise ops), and
  single-input ops that start a repeated layer;
* **followers** (ops with one tensor input: views, transposes, activations, dropout, reductions)
  take their layout from their input: :func:`follow` maps the input's Spec to the one strategy
  the follower uses, converting the input first where the op cannot run on it as it is (a softmax
  over a sharded dim, a GELU of a partial sum).

Unknown ops fall back to ``replicate``: every input gathered, the op run whole on every rank.
The fallback is explicit (``algorithm="replicate (fallback)"``) and listed in the report.
"""

from planner.rules.anchors import anchor_strategies, is_follower
from planner.rules.context import FALLBACK, RuleContext
from planner.rules.followers import follow

__all__ = ["FALLBACK", "RuleContext", "anchor_strategies", "follow", "is_follower"]
