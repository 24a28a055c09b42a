"""The schemes a problem is built from, in the order their hooks run (:mod:`planner.schemes`).

Adding a scheme: a module with a :class:`~planner.schemes.base.Scheme` subclass (its ``name``,
``setting``, ``searched`` and ``off``, and the hooks it needs), one entry here, its setting as a
field of :class:`planner.terms.Problem` and of :class:`planner.plan.Plan` (what the runtime reads),
the values a search tries as a field of :class:`planner.config.SearchConfig`, and its flag in
:mod:`planner.cli`. The search's configurations, the problem's keywords and the plan's settings
follow from the entry (:func:`planner.space.candidate_meshes`, :func:`planner.problem.build_problem`,
:func:`planner.assemble.make_plan`).
"""

from planner.schemes.base import Scheme
from planner.schemes.cdp import CDP
from planner.schemes.microbatch import MicroBatching
from planner.schemes.recompute import Recomputation
from planner.schemes.zero import ZeRO

SCHEMES: tuple[Scheme, ...] = (ZeRO(), CDP(), MicroBatching(), Recomputation())
