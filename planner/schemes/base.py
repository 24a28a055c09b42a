"""The protocol a parallelism scheme implements to take part in a planning problem.

:func:`planner.problem.build_problem` is the generic sum: it makes each node's strategies (the
tensor-parallel rules of :mod:`planner.rules`), prices each one's compute, collectives and memory,
and the edges between them (:mod:`planner.edges`). A scheme changes that sum where its dimension
acts, through the hooks below, each a no-op here; the registry (:data:`planner.schemes.registry.SCHEMES`)
runs them in its order, so a later scheme sees what an earlier one set (CDP replaces the
collective gradient sync ZeRO priced). In the order a problem is built, solved and evaluated:

0. :meth:`Scheme.values`, :meth:`Scheme.unsupported` and :meth:`Scheme.label`: a search's
   configurations are the product over the meshes of the values each scheme's setting takes
   (``Settings``: by each scheme's :attr:`Scheme.setting`, the keywords of
   :func:`planner.problem.build_problem`, e.g. ``{"zero_stage": 1, "cdp": "off", ...}``); a
   combination a scheme cannot run is pruned with its reason, and a configuration is printed as
   the mesh followed by each scheme's label;
1. :meth:`Scheme.configure`: check the problem's settings (a ValueError that names the setting and
   what to change) and settle what the scheme decides once (recomputation's segments, whether
   gradients are summed by collectives);
2. :meth:`Scheme.strategies`: strategy variants of the op anchors (ZeRO-3's re-gathers, CDP's
   partial gradients) and a filter of the strategies allowed;
3. :meth:`Scheme.param_storage`: the layouts a parameter may be stored in (ZeRO-3: split over
   the data-parallel axes);
4. :meth:`Scheme.prepare`: with every node's strategies known, the problem-wide constants of its
   pricing (the gradient buckets' shares of a latency);
5. :meth:`Scheme.price_param`, then :meth:`Scheme.price_op` for every node and strategy: what it
   holds and which collectives it runs (:class:`ParamPrice`, :class:`NodePrice`);
6. :meth:`Scheme.edges_priced`: terms that need the edges (CDP's stage buffers);
7. :meth:`Scheme.adjust`: an assignment's evaluation, where the scheme runs differently from the
   sum of its terms (ZeRO-3's units, CDP's messages per stage) (:class:`Tally`);
8. :meth:`Scheme.node_fields` and :meth:`Scheme.plan_fields`: what the scheme writes into the
   plan the runtime runs (:func:`planner.assemble.make_plan`).

What a person sees of a scheme is the scheme's too, so a new one reaches the command line and
every report without touching them: its :attr:`Scheme.flags` (:mod:`planner.cli` renders them,
their defaults are :class:`planner.config.SearchConfig`'s), its :attr:`Scheme.column` in the
report's tables (:meth:`Scheme.cell`), its part of a plan's summary, description and time
(:meth:`Scheme.summary`, :meth:`Scheme.describe`, :meth:`Scheme.time_lines`), its JSON fields
(:meth:`Scheme.fields`), its entry among ``planner explain``'s alternatives (:attr:`Scheme.title`)
and the advice it gives when nothing fits (:meth:`Scheme.advice`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from planner.config import SearchConfig
    from planner.ir import IRGraph, Node
    from planner.mesh import Mesh
    from planner.peak import Var
    from planner.plan import Plan
    from planner.strategy import Comm, Strategy
    from planner.terms import Evaluation, Problem, StrategyFilter


@dataclass
class ParamPrice:
    """One parameter under one strategy, per device, one instance: the bytes it holds and its
    gradient sync. Starts as plain replication (no sync); the data-parallel scheme sets the sync."""

    params: float
    grads: float
    states: float  # optimizer states (and master copy)
    step: list[Comm] = field(default_factory=list)  # the gradient sync and updated-parameter collectives
    held: float = 0.0  # bytes held through the whole step beside them (CDP v1's previous buffer)
    versions: int = 1  # parameter versions in ``params`` (CDP v2 keeps two)


@dataclass
class NodePrice:
    """One node under one strategy: seconds (all micro-batches, one instance) before its
    collectives are added, the collectives it runs, and what it contributes beside them."""

    compute: float  # its compute, all micro-batches
    seconds: float  # compute plus what schemes add (the optimizer step, recomputation)
    comms: list[Comm]
    count: int  # instances
    credit: float = 0.0  # seconds evaluate() may hide behind compute, all instances
    rerun: float | None = None  # seconds recomputation adds, all instances (None: nothing recomputed)
    rerun_comms: list[Comm] = field(default_factory=list)  # the collectives it runs again, in each recomputed instance
    rerun_instances: int = 0  # the instances recomputed
    loss_partial: frozenset[str] | None = None  # the output's loss: the axes it is still a partial sum over


@dataclass
class Tally:
    """An evaluation being summed (:func:`planner.problem.evaluate`), for schemes to adjust."""

    total: float  # step seconds before anything is hidden
    comm_time: float
    hidden: float  # seconds hidden behind compute
    comms: list[tuple[Comm, int]]
    activations: float
    optimizer: float
    during: float  # the peak of the forward and backward
    peak_at: str
    step_transient: float
    value: Callable[[Var], float]  # the assignment's value of an ILP indicator (planner.peak.Var)
    held: float = 0.0  # bytes held through the whole step beyond what the sum priced (a scheme's exact count in place of its linear price)
    params: float = 0.0  # parameter bytes beyond what the sum priced, likewise


@dataclass(frozen=True)
class Flag:
    """A command-line flag of a scheme, which sets :class:`planner.config.SearchConfig`'s ``field``
    (its default is the field's): a comma list of ``item`` values (``many``; ``choices``, when
    given, are the values allowed), one value, or, with ``switch_off``, a switch that sets the
    field to False (``--no-prefetch``)."""

    name: str
    field: str
    help: str
    item: type = str
    choices: tuple[Any, ...] | None = None
    many: bool = True
    switch_off: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse reads the flag into."""
        return self.name.removeprefix("--").replace("-", "_")


Settings = Mapping[str, Any]  # a configuration's scheme settings, by build_problem keyword
OFF: dict[str, Any] = {}  # each scheme's setting and the value that leaves it out, as the schemes are defined


def settings_of(plan: Plan) -> Settings:
    """The scheme settings a :class:`planner.plan.Plan` holds, each under its name (a
    :class:`planner.terms.Problem` holds them as ``problem.settings``)."""
    return {key: getattr(plan, key) for key in OFF}


class Scheme:
    """One parallelism dimension (see the module docstring for when each hook runs).

    ``setting``: its setting's name, the keyword :func:`planner.problem.build_problem` takes, the
    key of ``Problem.settings`` and the attribute a :class:`planner.plan.Plan` holds it by;
    ``searched``: the field of :class:`planner.config.SearchConfig` that lists the values a search
    tries; ``off``: the value that leaves the scheme out (a problem built without the keyword);
    ``flags``: its command-line flags; ``column``: its column's header in the report's tables;
    ``title``: its name where ``planner explain`` compares plans by their settings."""

    name: ClassVar[str]
    setting: ClassVar[str]
    searched: ClassVar[str]
    off: ClassVar[Any]
    flags: ClassVar[tuple[Flag, ...]] = ()
    column: ClassVar[str]
    title: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        OFF[cls.setting] = cls.off

    def values(self, config: SearchConfig, mesh: Mesh) -> tuple[Any, ...]:
        """The values of its setting a search of ``config`` tries on ``mesh``."""
        return tuple(getattr(config, self.searched))

    def unsupported(self, mesh: Mesh, settings: Settings, graph: IRGraph | None = None) -> str:
        """Why this scheme cannot run ``settings`` on ``mesh`` ("" when it can): the search prunes
        the configuration with this reason, and :meth:`configure` raises it. With ``graph`` (the
        search's), also what the model lacks for it (a search prunes a setting that would change
        nothing on this model)."""
        return ""

    def label(self, settings: Settings) -> str:
        """The scheme's part of a configuration's name ("" where it is off)."""
        return ""

    def edge_key(self, value: Any) -> Any:
        """What of its setting's ``value`` changes the conversion and hold terms: problems alike
        in it (and in their strategies) share their priced edges (:func:`planner.edges.shared_edges`;
        ZeRO 0, 1 and 2 of one mesh do)."""
        return value

    def configure(self, problem: Problem) -> None:
        """Check the settings; settle what the scheme decides once per problem."""

    def strategies(self, problem: Problem, anchors: dict[str, list[Strategy]], allow: StrategyFilter | None) -> StrategyFilter | None:
        """Replace op anchors' strategy lists in ``anchors`` (by node name) with their variants;
        return the filter of allowed strategies (``allow``, narrowed or as it is)."""
        return allow

    def param_storage(self, problem: Problem, node: Node, strategies: list[Strategy]) -> list[Strategy]:
        """The storage layouts of parameter ``node``, given the tensor-parallel ones."""
        return strategies

    def prepare(self, problem: Problem) -> None:
        """Problem-wide constants of the pricing, once every node's strategies are known."""

    def price_param(self, problem: Problem, node: Node, index: int, strategy: Strategy, price: ParamPrice, opt_factor: float) -> None:
        """Change parameter ``node``'s price under its ``index``-th strategy (``opt_factor``:
        optimizer bytes per parameter byte)."""

    def price_op(self, problem: Problem, node: Node, strategy: Strategy, price: NodePrice) -> None:
        """Change ``node``'s price under ``strategy`` (every node kind; after :meth:`price_param`)."""

    def edges_priced(self, problem: Problem) -> None:
        """Add terms that need the conversion and hold terms."""

    def adjust(self, problem: Problem, assignment: dict[str, int], tally: Tally) -> None:
        """Change an assignment's evaluation where the scheme runs otherwise than its terms sum."""

    def node_fields(self, problem: Problem, name: str) -> dict[str, Any]:
        """Fields of node ``name``'s :class:`planner.plan.NodePlan` the scheme sets (what the runtime
        reads of it: recomputation's segment)."""
        return {}

    def plan_fields(self, problem: Problem, evaluation: Evaluation) -> dict[str, Any]:
        """Fields of the :class:`planner.plan.Plan` the scheme sets beside its setting (the
        seconds it adds to the step, its own parameters)."""
        return {}

    # ------------------------------------------------------------------ what a person sees

    def cell(self, settings: Settings, plan: Plan | None = None) -> str:
        """Its cell in a row of the report's tables: a configuration's ``settings``, and, where it
        has one, its ``plan``."""
        return str(settings[self.setting])

    def summary(self, plan: Plan) -> str:
        """Its part of a plan's one-line summary ("" where it says nothing: off)."""
        return self.label(settings_of(plan))

    def describe(self, plan: Plan) -> list[str]:
        """Lines of a plan's description (:func:`planner.report.format_plan`): what it runs and how."""
        return []

    def time_lines(self, plan: Plan) -> list[str]:
        """Lines of ``planner explain``'s time section: the seconds it adds and why."""
        return []

    def fields(self, plan: Plan) -> dict[str, Any]:
        """Its fields in a front point of ``planner report --json``."""
        return {self.setting: getattr(plan, self.setting)}

    def advice(self, config: SearchConfig, graph: IRGraph, memory: Mapping[str, float]) -> str:
        """What to search to need less memory, when no plan fits ("" for nothing): ``memory`` is
        the least-memory plan's terms (params, grads, optimizer, activations, ...)."""
        return ""
