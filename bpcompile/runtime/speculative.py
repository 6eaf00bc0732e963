"""Tree speculative decoding: draft trees, TensorRT-LLM's packed tree mask, lossless verification.

Conventions (TensorRT-LLM's, so its tree masks and ours have the same layout):
- A step's tree has G nodes. Node 0 is the last committed token (the "true" token, depth 0, not yet in
  the verifier's KV cache); nodes 1..G-1 are draft tokens. Parents always have smaller indices than
  their children, so index order is a topological order. `TreeSpec.nodes/length/len(choices)` count
  draft tokens, so G = that + 1.
- The verifier sees node i at position `context_len + depth(i)` (siblings share a RoPE position).
- Tree mask: row i, bit j (bit j%32 of int32 word j//32, little-endian; bit 31 makes the word negative)
  is set iff node i may attend to node j: itself, its ancestors, node 0. Committed context is visible
  to every node implicitly.

Draft trees (the draft runs one batched forward per round; see runtime.Generator._draft)
- chain: K tokens, one per depth (greedy: the draft's top-1; sampling: one draw from q).
- static: Medusa/EAGLE choices; choice [a, b] is the b-th candidate below the a-th candidate below node 0
  (greedy: top-k index; sampling: the k-th independent draw from q). Nodes in TensorRT-LLM's order.
- dynamic: best-first within a node budget. Sampling: by the draft's cumulative probability. Greedy: by
  the cumulative *acceptance estimate*: the draft's probability mapped through acceptance rates seen in
  earlier steps (AcceptanceCalibration), because greedy verification accepts the verifier's argmax,
  which a small draft's softmax under-states.

Verification
- Greedy (temperature 0): walk from node 0; at each node take the verifier's argmax; if a child holds
  that token, descend, else stop. The argmax at the last accepted node is the bonus token. The
  committed tokens are then exactly what verifier-only greedy decoding produces.
- Sampling: multi-draft speculative sampling with candidates drawn *with replacement* from the draft
  distribution q (SpecInfer's multi-step speculative sampling / recursive rejection sampling). At a
  node with target distribution r and candidates c_1, c_2, ... (in draw order):
      accept c_k with probability min(1, r(c_k)/q(c_k)); on rejection r <- normalize(max(r - q, 0))
  and try c_{k+1}; when no candidate is left, sample the bonus token from r.
  Why this is exact: one round (candidate c ~ q, accept w.p. min(1, r/q), else continue from the
  residual) outputs exactly r if whatever follows outputs exactly the residual (Leviathan et al. /
  Chen et al. lemma). The residual depends only on r and q, not on the rejected token, so by
  induction from the last candidate backwards every node outputs exactly its target. The induction
  needs each c_k ~ q independently of everything the verifier has already looked at, which holds
  because (a) candidates are fresh independent draws from q and (b) the decision *whether* node X
  gets a k-th candidate never looks at that candidate's value (only at earlier draws: a stopping
  rule). Static trees fix the candidate counts in advance; the dynamic tree's best-first scores for
  "draw another child at X" use only cum_q(X) and the q-mass of X's existing children. A duplicate
  draw (a token X already has as a child) is kept as a repeated candidate pointing at the same node:
  it gets rejected for free (after that token's rejection r(c) = 0) but its residual update is still
  applied, exactly as the proof requires. Sampling *without* replacement would need a different
  rule (Sequoia's), so it is not used.
  The target at a child node is the verifier's distribution given the path, i.e. the verifier's
  sampling distribution (temperature, top-k, top-p applied) at that position: the output is
  distributed exactly as verifier-only sampling with the same parameters.
"""

from __future__ import annotations

import heapq
import json
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from bpcompile.core.errors import UserError
from bpcompile.kernels.tree_mask import pack_rows

TREE_KINDS = ("none", "chain", "static", "dynamic")


@dataclass
class TreeSpec:
    kind: str = "none"  # none | chain | static | dynamic
    length: int = 5  # chain: draft tokens per step
    choices: Optional[list[list[int]]] = None  # static: Medusa/EAGLE choices (top-k index per depth)
    nodes: int = 5  # dynamic: draft-token budget per step

    def __post_init__(self):
        if self.kind not in TREE_KINDS:
            raise UserError(f"tree kind {self.kind!r}: expected one of {', '.join(TREE_KINDS)}", key="speculative.tree")
        if self.kind == "chain" and not (isinstance(self.length, int) and self.length >= 1):
            raise UserError(f"chain length {self.length!r}: expected an integer >= 1", key="speculative.length")
        if self.kind == "dynamic" and not (isinstance(self.nodes, int) and self.nodes >= 1):
            raise UserError(f"dynamic tree nodes {self.nodes!r}: expected an integer >= 1", key="speculative.nodes")
        if self.kind == "static":
            self.choices = [list(c) for c in sort_choices(self.choices)]

    @property
    def draft_tokens(self) -> int:
        """Most draft tokens one step proposes (G - 1)."""
        return {"none": 0, "chain": self.length, "static": len(self.choices or []), "dynamic": self.nodes}[self.kind]


def parse_tree_spec(text: str) -> TreeSpec:
    """`none` | `chain:5` | `dynamic:5` | `static:[[0],[1],[0,0]]` (the CLI's --tree)."""
    kind, _, arg = text.strip().partition(":")
    kind = kind.strip().lower()
    try:
        if kind == "none" and not arg:
            return TreeSpec("none")
        if kind == "chain":
            return TreeSpec("chain", length=int(arg or 5))
        if kind == "dynamic":
            return TreeSpec("dynamic", nodes=int(arg or 5))
        if kind == "static" and arg:
            return TreeSpec("static", choices=json.loads(arg))
    except (ValueError, TypeError) as e:
        raise UserError(f"--tree {text!r}: {e}") from None
    raise UserError(f"--tree {text!r}: expected none, chain:N, dynamic:N or static:<json list of choices>")


def sort_choices(choices) -> list[tuple[int, ...]]:
    """Validate static choices and put them in TensorRT-LLM's node order: by depth, then lexicographic."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise UserError("static tree needs choices, e.g. [[0], [1], [0, 0]]", key="speculative.choices")
    paths = set()
    for c in choices:
        if (
            not isinstance(c, (list, tuple))
            or not c
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in c)
        ):
            raise UserError(
                f"choice {c!r}: expected a non-empty list of non-negative top-k indices", key="speculative.choices"
            )
        paths.add(tuple(c))
    for p in paths:
        if len(p) > 1 and p[:-1] not in paths:
            raise UserError(f"choice {list(p)} has no parent {list(p[:-1])} in choices", key="speculative.choices")
    return sorted(paths, key=lambda p: (len(p), p))


# ---------------------------------------------------------------------------------------------- masks

# ------------------------------------------------------------------------------------------- sampling


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution (float64, on CPU) of one logits row: temperature, then top-k, then top-p."""
    x = logits.detach().to("cpu", torch.float64) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, idx = torch.sort(p, descending=True)
        drop = (torch.cumsum(sp, 0) - sp) >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False
        p = p.clone()
        p[idx[drop]] = 0.0
        p = p / p.sum()
    return p


def sample(p: torch.Tensor, rng: torch.Generator, n: int = 1) -> list[int]:
    """n independent draws from p (inverse CDF: cheaper than torch.multinomial for one row)."""
    c = torch.cumsum(p, 0)
    u = torch.rand(n, generator=rng, dtype=c.dtype) * c[-1]
    # first index whose cumulative mass exceeds u: a zero-probability token can never be returned
    return torch.searchsorted(c, u, right=True).clamp_(max=p.shape[0] - 1).tolist()


def uniform(rng: torch.Generator) -> float:
    return torch.rand((), generator=rng, dtype=torch.float64).item()


# --------------------------------------------------------------------------------------------- trees


@dataclass
class Sampling:
    """How one request samples (temperature 0 = greedy) and its own random stream."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    rng: Optional[torch.Generator] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)


@dataclass
class DraftTree:
    """One step's token tree. Node 0 is the last committed token."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    bits: list[int] = field(default_factory=lambda: [1])  # mask rows as ints
    draws: dict[int, list[int]] = field(default_factory=dict)  # candidates per node, in draw order (repeats allowed)
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # draft distribution at expanded nodes (sampling)
    forwarded: set[int] = field(default_factory=set)  # nodes (>0) whose KV is in the draft cache
    conf: dict[int, tuple[float, bool]] = field(default_factory=dict)  # greedy dynamic: (draft prob, was top-1)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.bits.append(self.bits[parent] | (1 << i))
        self.draws.setdefault(parent, []).append(i)
        return i

    def child_with_token(self, node: int, token: int) -> Optional[int]:
        for c in self.draws.get(node, ()):
            if self.tokens[c] == token:
                return c
        return None

    def packed_mask(self, words: Optional[int] = None) -> torch.Tensor:
        return pack_rows(self.bits, words or (len(self) + 31) // 32)


class Columns:
    """What a draft's logits columns are when it scores only some token ids (FeatureDraft.proposable): column j
    is token ids[j]. A draft distribution q over them is widened to the whole vocabulary (zero elsewhere) for
    sampling, whose acceptance rule compares it with the verifier's."""

    def __init__(self, ids: torch.Tensor, vocab_size: int):
        self.ids, self.vocab_size = ids.to("cpu", torch.int64), vocab_size
        self.tokens = self.ids.tolist()

    def widen(self, q: torch.Tensor) -> torch.Tensor:
        return q.new_zeros(self.vocab_size).index_copy_(0, self.ids, q)


class _Builder:
    """Grows a DraftTree from draft logits. `expand({node: logits})` consumes the draft's logits at the
    nodes it asked for (first call: {0: logits after the last committed token}) and returns the nodes
    whose logits it needs next; [] means the tree is complete. columns: the logits' token ids when the draft
    scores only some (None: column j is token j)."""

    def __init__(self, tree: DraftTree, s: Sampling, max_depth: int, columns: Optional[Columns] = None):
        self.tree, self.s, self.max_depth, self.columns = tree, s, max_depth, columns

    def expand(self, logits: dict[int, torch.Tensor]) -> list[int]:
        raise NotImplementedError

    def _token(self, j: int) -> int:
        return j if self.columns is None else self.columns.tokens[j]

    def _q(self, row: torch.Tensor) -> torch.Tensor:
        """The draft's sampling distribution over the whole vocabulary."""
        q = self.s.probs(row)
        return q if self.columns is None else self.columns.widen(q)

    def _candidates(self, node: int, row: torch.Tensor, n: int) -> list[int]:
        """n candidate tokens below `node`: top-n (greedy) or n independent draws from q (sampling)."""
        if self.s.greedy:
            return [self._token(j) for j in torch.topk(row, n).indices.tolist()]
        q = self.tree.q[node] = self._q(row)
        return sample(q, self.s.rng, n)


class ChainBuilder(_Builder):
    def __init__(self, tree, s, max_depth, length, columns=None):
        super().__init__(tree, s, min(max_depth, length), columns)

    def expand(self, logits):
        ((node, row),) = logits.items()
        child = self.tree.add(node, self._candidates(node, row, 1)[0])
        return [child] if self.tree.depths[child] < self.max_depth else []


class StaticBuilder(_Builder):
    def __init__(self, tree, s, max_depth, choices, columns=None):
        super().__init__(tree, s, max_depth, columns)
        self.kids: dict[tuple, list[int]] = {}  # path -> top-k indices of its children
        for c in sort_choices(choices):
            if len(c) <= max_depth:
                self.kids.setdefault(tuple(c[:-1]), []).append(c[-1])
        self.path = {0: ()}

    def expand(self, logits):
        nxt = []
        for node, row in logits.items():
            ks = self.kids.get(self.path[node], [])
            if not ks:
                continue
            cand = self._candidates(node, row, min(max(ks) + 1, row.shape[-1]))
            for k in ks:  # a skipped top-k index is simply a draw that is not used (still lossless)
                if k >= len(cand):
                    continue
                child = self.tree.add(node, cand[k])
                self.path[child] = self.path[node] + (k,)
                if self.path[child] in self.kids:
                    nxt.append(child)
        return nxt


class AcceptanceCalibration:
    """Online estimate of P(a greedy draft candidate is accepted | its draft probability q, whether it is the
    draft's top-1), shared by all requests of a Generator.

    Greedy verification accepts a child iff it is the verifier's argmax. The draft's softmax estimates the
    verifier's *sampling* distribution, which for a small, uncertain verifier is much flatter than "is the
    argmax": on the tiny pair, top-1 drafts with q ~ 0.4 are accepted ~80% of the time. Scoring a greedy
    tree by raw q then spends the node budget on siblings instead of depth (tau 2.3 vs 3.4 for a chain).
    So greedy dynamic trees are scored by q mapped through acceptance rates observed in earlier steps:
    counts per (top-1 or not, q in tenths), with a prior of `prior` pseudo-observations at rate q (so it
    starts as EAGLE-2's raw draft confidence). Only the tree's shape depends on it, never the output.
    """

    BINS = 10

    def __init__(self, prior: float = 4.0):
        self.prior = prior
        self.acc = [[0.0] * self.BINS for _ in range(2)]
        self.n = [[0.0] * self.BINS for _ in range(2)]

    def __call__(self, q: float, top1: bool) -> float:
        i, b = 0 if top1 else 1, min(int(q * self.BINS), self.BINS - 1)
        return (self.acc[i][b] + self.prior * q) / (self.n[i][b] + self.prior)

    def update(self, tree: "DraftTree", path: list[int]) -> None:
        """Every child of an accepted node was tested against the verifier's argmax: count the outcomes."""
        on = set(path)
        for node in path:
            for c in tree.draws.get(node, ()):
                if c in tree.conf:
                    q, top1 = tree.conf[c]
                    i, b = 0 if top1 else 1, min(int(q * self.BINS), self.BINS - 1)
                    self.n[i][b] += 1
                    self.acc[i][b] += c in on


class DynamicBuilder(_Builder):
    """Best-first growth by cumulative probability, `budget` draft tokens.

    Heap entries: ("draw", X): add X's next child, scored by cum(X) * (greedy: the calibrated acceptance
    estimate of X's next-best token, see AcceptanceCalibration; sampling: q-mass X's children do not cover
    yet); ("open", X): X's children are unknown until the draft runs X, scored by cum(X), an upper bound
    of any child's score. Popping an "open" entry ends the round: the runtime forwards X (one draft
    forward per round for all sequences).
    """

    def __init__(self, tree, s, max_depth, budget, calib: Optional[AcceptanceCalibration] = None, columns=None):
        super().__init__(tree, s, max_depth, columns)
        self.budget, self.heap, self.n = budget, [], 0
        self.calib = calib
        self.cum = {0: 1.0}
        self.ranked: dict[int, list[tuple[float, int]]] = {}  # greedy: (prob, token) best first
        self.rank: dict[int, int] = {}  # greedy: children taken so far per node
        self.last: dict[int, float] = {}  # greedy: estimate of the last child taken (scores never rise with rank)
        self.dups = 0
        self.covered: dict[int, float] = {}  # sampling: q-mass of each node's distinct children

    def _push(self, score, kind, node):
        self.n += 1
        heapq.heappush(self.heap, (-score, self.n, kind, node))

    def _est(self, x) -> float:
        """Greedy: acceptance estimate of x's next-ranked token."""
        q = self.ranked[x][self.rank[x]][0]
        e = self.calib(q, self.rank[x] == 0) if self.calib is not None else q
        return min(e, self.last.get(x, 1.0))

    def _push_draw(self, x):
        """Sampling: score of one more draw at x from what x already has (never from the draw itself)."""
        rest = 1.0 - self.covered.get(x, 0.0)
        if rest > 1e-6 and self.dups < 4 * self.budget:  # cap: a peaked q would keep redrawing its top token
            self._push(self.cum[x] * rest, "draw", x)

    def expand(self, logits):
        t = self.tree
        for node, row in logits.items():
            if self.s.greedy:
                pr = torch.softmax(row.float(), -1)
                v, i = torch.topk(pr, min(self.budget, pr.shape[-1]))
                self.ranked[node] = list(zip(v.tolist(), map(self._token, i.tolist())))
                self.rank[node] = 0
                self._push(self.cum[node] * self._est(node), "draw", node)
            else:
                t.q[node] = self._q(row)
                self._push(self.cum[node], "draw", node)
        added = len(t) - 1
        while self.heap and added < self.budget:
            _, _, kind, x = heapq.heappop(self.heap)
            if kind == "open":
                return [x]
            if self.s.greedy:
                pr = self.last[x] = self._est(x)
                q, tok = self.ranked[x][self.rank[x]]
                top1 = self.rank[x] == 0
                self.rank[x] += 1
                if self.rank[x] < len(self.ranked[x]):
                    self._push(self.cum[x] * self._est(x), "draw", x)
            else:
                q = t.q[x]
                tok = sample(q, self.s.rng)[0]
                pr = float(q[tok])
                old = t.child_with_token(x, tok)
                if old is not None:  # repeated draw: a candidate again, no new node (see module docstring)
                    t.draws[x].append(old)
                    self.dups += 1
                    self._push_draw(x)
                    continue
            child = t.add(x, tok)
            if self.s.greedy:
                t.conf[child] = (q, top1)
            else:
                self.covered[x] = self.covered.get(x, 0.0) + pr
                self._push_draw(x)
            added += 1
            self.cum[child] = self.cum[x] * pr
            if t.depths[child] < self.max_depth:
                self._push(self.cum[child], "open", child)
        return []


class BackOff:
    """Speculation that never costs much: when drafting does not pay, draft less or not at all for a while.

    It decides from quantities that stay the same when the machine is uniformly slower or busier (so a loaded
    machine decides as an idle one does), never from absolute times taken at different moments:
    - a: accepted draft tokens per sequence and drafting step: a drafting step commits 1 + a tokens per
      sequence, a plain step 1;
    - c: a drafting step's time over a plain step's, as s * r, two ratios of times taken close together:
      s = a drafting step's time / its own verifier forward's (the draft's rounds and the tree bookkeeping
      relative to the verify), median of the last `window` drafting steps; r = a drafting step's verifier
      forward / the whole plain step next to it (the one just before or after: the same load), median of the
      last `window` such pairs, 1 until three are seen (verifying a tree costs no less than one token: it errs
      towards drafting). To keep r current while drafting pays, one step in `refresh` drafts nothing (one in
      `refresh // 8` until `min_pairs` pairs are known).
    Drafting pays when g = (1 + a) / c > 1. It is judged over `probe` drafting steps with the recipe's whole
    tree (at the start, and after each pause), a their mean acceptance and s their median, then after every
    drafting step (a a running mean, s over the window). With hysteresis (`margin`) so that noise does not flip
    it: a probe turns drafting on when g >= 1 + margin, and drafting goes off when g < 1 - margin. Off, the next
    `wait` steps draft nothing and a probe follows; each failed probe doubles `wait` (up to `max_wait`), a good
    one resets it. While drafting, chains and dynamic trees are cut to about twice the accepted length plus one
    (they grow back as acceptance does).

    Only future steps' trees depend on it, and only through past steps: greedy output stays identical to
    verifier-only decoding, and sampling stays lossless (whether a step drafts, and how many candidates, is
    fixed before any of its draws: the stopping-rule argument in the module docstring).
    """

    def __init__(
        self,
        spec: TreeSpec,
        first_wait: int = 4,
        max_wait: int = 64,
        decay: float = 0.3,
        margin: float = 0.1,
        window: int = 9,
        probe: int = 3,
        refresh: int = 64,
        min_pairs: int = 4,
    ):
        self.spec, self.first_wait, self.max_wait, self.decay, self.margin = spec, first_wait, max_wait, decay, margin
        self.probe, self.refresh, self.min_pairs = probe, refresh, min_pairs
        self.wait, self.skip = first_wait, 0
        self.probing: Optional[list[float]] = []  # acceptance of the current probe's steps (None: not probing)
        self.accepted: Optional[float] = None
        self.share: deque[float] = deque(maxlen=window)  # s of recent drafting steps
        self.pairs: deque[float] = deque(maxlen=window)  # r of recent adjacent (drafting, plain) step pairs
        self.last: Optional[tuple[bool, float, float]] = None  # the previous step: drafted, seconds, verify seconds
        self.since_plain = 0  # drafting steps since the last plain one
        self.backoffs = 0  # times drafting was switched off (benchmarks and tests read it)
        self.plain_steps = 0  # steps back-off made plain (refreshes of r included)

    @property
    def gain(self) -> Optional[float]:
        """g = (1 + a) / c: tokens a drafting step yields per plain step's worth of time (None before any)."""
        if self.accepted is None or not self.share:
            return None
        r = statistics.median(self.pairs) if len(self.pairs) >= 3 else 1.0  # one or two pairs: too noisy
        return (1 + self.accepted) / (statistics.median(self.share) * r)

    def next_spec(self) -> TreeSpec:
        """The tree to draft this step (kind "none": no drafting)."""
        every = self.refresh if len(self.pairs) >= self.min_pairs else max(1, self.refresh // 8)
        if self.skip > 0 or (self.probing is None and self.since_plain >= every):
            self.skip = max(0, self.skip - 1)
            self.plain_steps += 1
            return TreeSpec("none")
        s = self.spec
        if self.probing is not None or s.kind not in ("chain", "dynamic"):
            return s
        n = max(1, min(s.draft_tokens, int(2 * self.accepted + 1.5)))
        return TreeSpec(s.kind, length=n, nodes=n)

    def update(self, drafted: bool, accepted: float, seconds: float, verify_seconds: float) -> None:
        """After a step: whether it drafted, accepted draft tokens per drafting sequence, its wall time and the
        verifier forward's share of it."""
        last, self.last = self.last, (drafted, seconds, verify_seconds)
        if last is not None and last[0] != drafted and seconds > 0 and last[1] > 0:  # an adjacent pair
            self.pairs.append(verify_seconds / last[1] if drafted else last[2] / seconds)
        if not drafted:
            self.since_plain = 0
            return
        self.since_plain += 1
        if verify_seconds > 0:
            self.share.append(seconds / verify_seconds)
        if self.probing is not None:  # a probe starts afresh: acceptance long ago says little about now
            self.probing.append(accepted)
            if len(self.probing) < self.probe:
                return
            self.accepted = sum(self.probing) / len(self.probing)
            g = self.gain
            if g is None or g >= 1 + self.margin:
                self.wait, self.probing = self.first_wait, None
            else:
                self._off()
            return
        self.accepted += self.decay * (accepted - self.accepted)
        g = self.gain
        if g is not None and g < 1 - self.margin:
            self._off()

    def _off(self) -> None:
        self.skip = self.wait
        self.wait = min(2 * self.wait, self.max_wait)
        self.backoffs += 1
        self.probing = []
        self.share.clear()  # the probe measures afresh (the machine's load may have changed)


def make_builder(
    spec: TreeSpec,
    root_token: int,
    s: Sampling,
    max_depth: int,
    calib: Optional[AcceptanceCalibration] = None,
    columns: Optional[Columns] = None,
) -> tuple[DraftTree, Optional[_Builder]]:
    """The tree for one step and its builder (None: no drafting this step, the tree is node 0 alone)."""
    tree = DraftTree([root_token])
    if spec.kind == "none" or max_depth < 1:
        return tree, None
    if spec.kind == "chain":
        return tree, ChainBuilder(tree, s, max_depth, spec.length, columns)
    if spec.kind == "static":
        return tree, StaticBuilder(tree, s, max_depth, spec.choices, columns)
    return tree, DynamicBuilder(tree, s, max_depth, spec.nodes, calib, columns)


# -------------------------------------------------------------------------------------- verification

# rule(p, q, token, u) -> (accepted, target for the next candidate). Injectable so tests can prove that a
# wrong rule is caught by the statistical test.
AcceptRule = Callable[[torch.Tensor, torch.Tensor, int, float], tuple[bool, torch.Tensor]]


def residual_rule(p: torch.Tensor, q: torch.Tensor, token: int, u: float) -> tuple[bool, torch.Tensor]:
    if u * float(q[token]) < float(p[token]):  # u < p/q without dividing (q[token] > 0: it was drawn)
        return True, p
    r = (p - q).clamp_min(0.0)
    s = float(r.sum())
    # s == 0 only if p == q up to rounding, where rejection has probability ~0; keep p then.
    return False, (r / s if s > 0 else p)


def verify_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """argmax[i] = the verifier's argmax after node i -> (accepted path of node ids starting at 0, bonus)."""
    path = [0]
    while True:
        tok = argmax[path[-1]]
        child = tree.child_with_token(path[-1], tok)
        if child is None:
            return path, tok
        path.append(child)


def verify_sampling(
    tree: DraftTree, target: Callable[[int], torch.Tensor], rng: torch.Generator, rule: AcceptRule = residual_rule
) -> tuple[list[int], int]:
    """target(i) = the verifier's sampling distribution after node i (float64, CPU)."""
    path = [0]
    while True:
        node = path[-1]
        p = target(node)
        nxt = None
        for c in tree.draws.get(node, ()):
            ok, p = rule(p, tree.q[node], tree.tokens[c], uniform(rng))
            if ok:
                nxt = c
                break
        if nxt is None:
            return path, sample(p, rng)[0]
        path.append(nxt)
