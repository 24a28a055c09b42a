"""The schemes a problem is built from, in the order their hooks run (:mod:`planner.schemes`).

Adding a scheme: a module with a :class:`~planner.schemes.base.Scheme` subclass, one entry here,
its setting on :class:`planner.terms.Problem` (and :class:`planner.config.SearchConfig` when the
search explores it).
"""

from planner.schemes.base import Scheme
from planner.schemes.cdp import CDP
from planner.schemes.microbatch import MicroBatching
from planner.schemes.recompute import Recomputation
from planner.schemes.zero import ZeRO

SCHEMES: tuple[Scheme, ...] = (ZeRO(), CDP(), MicroBatching(), Recomputation())
