"""The schemes a problem is built from, in the order their hooks run (:mod:`planner.schemes`).

Adding a scheme touches three files beside its own module: a :class:`~planner.schemes.base.Scheme`
subclass there (its ``name``, ``setting``, ``searched``, ``off``, ``flags``, ``column``, ``title``
and the hooks it needs), one entry here, the values a search tries as a field of
:class:`planner.config.SearchConfig`, and its setting as a field of :class:`planner.plan.Plan`
(with what else of it the runtime reads). The search's configurations, the problem's keywords and
settings (``Problem.settings``), the plan's settings, the command line's flags, the report's
columns and lines, ``planner explain`` and the JSON follow from the entry. A scheme the runtime
runs differently also needs its runtime half (as :mod:`planner.runtime.recompute`, called from
:func:`planner.runtime.compile.compile_plan`).
"""

from planner.schemes.base import Scheme
from planner.schemes.cdp import CDP
from planner.schemes.microbatch import MicroBatching
from planner.schemes.recompute import Recomputation
from planner.schemes.zero import ZeRO

SCHEMES: tuple[Scheme, ...] = (ZeRO(), CDP(), MicroBatching(), Recomputation())
