"""Independent Python reference of DDTree's tree build (paper Algorithm 1, SPEC-DDTREE.md §2).

Written from the spec only (not from src/decode/tree.*), with numpy + heapq, so that the C++ build can be
checked against it exactly. The definitions both sides follow:

* K = min(budget, V). Per position i the V tokens are ranked by logit descending, ties by the LOWER token
  id, and the first K kept: top_ids[i, r], top_logits[i, r].
* logp[i, r] = float32(float64(top_logits[i, r]) − LSE_i), where LSE_i is the logsumexp of the whole row i
  in float64, max-subtracted: m + log(Σ_v exp(x_v − m)), the sum taken in token order.
* Scores σ are float64 and updated incrementally: node (0,) starts at logp[0, 0]; popping a node with rank
  tuple ρ (depth d, last rank r, score σ) pushes its next sibling (if r+1 < K) with
  (σ − logp[d−1, r]) + logp[d−1, r+1], and its first child (if d < L) with σ + logp[d, 0].
* The heap is Python's heapq on (−σ, ρ, parent): larger σ first, then the lexicographically smaller rank
  tuple, then the smaller parent index.
* Nodes are numbered 1..n in pop order (0 is the root, the bonus token, not drawn from the logits); the
  loop stops when n == budget or the heap is empty.
* Visibility: row 0 = {0}; row i = row[parent[i]] ∪ {i}.

`build_tree(logits, budget)` returns a dict with the same keys and layout as `kdtree tree --json`.
Run as a script (`python ddtree_reference.py FILE.safetensors BUDGET`) it prints that JSON object.
"""
from __future__ import annotations

import heapq
import json
import math
import sys
from dataclasses import dataclass

import numpy as np


@dataclass
class TopK:
    K: int
    ids: np.ndarray  # [L, K] int64
    logits: np.ndarray  # [L, K] float32
    lse: np.ndarray  # [L] float64
    logp: np.ndarray  # [L, K] float32


def row_logsumexp(row: np.ndarray) -> float:
    """float64 logsumexp of one row, max-subtracted, summed sequentially in token order (libm exp/log).
    The row must hold no NaN / +inf and at least one finite value (checked by `topk_logp`)."""
    x = [float(v) for v in np.asarray(row, dtype=np.float32)]
    m = max(x)
    s = 0.0
    for v in x:
        s += math.exp(v - m)
    return m + math.log(s)


def topk_logp(logits: np.ndarray, budget: int) -> TopK:
    logits = np.asarray(logits)
    if logits.dtype != np.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be [L, V], got shape {logits.shape}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    L, V = logits.shape
    if L < 1 or V < 1:
        raise ValueError(f"logits must have L >= 1 and V >= 1, got shape {logits.shape}")
    # Outside this domain the spec's arithmetic gives NaN (x − LSE with LSE = ±inf or NaN): reject it.
    if np.isnan(logits).any():
        raise ValueError("logits hold NaN")
    if np.isposinf(logits).any():
        raise ValueError("logits hold +inf")
    if (~np.isfinite(logits)).all(axis=1).any():
        raise ValueError("a logits row has no finite value")
    K = min(budget, V)
    ids = np.empty((L, K), dtype=np.int64)
    top = np.empty((L, K), dtype=np.float32)
    lse = np.empty(L, dtype=np.float64)
    logp = np.empty((L, K), dtype=np.float32)
    for i in range(L):
        row = logits[i]
        # Stable sort of the negated row: descending logit, equal logits keep ascending token id.
        # (−(−inf) = +inf sorts last; −0.0 and +0.0 compare equal and so tie by id.)
        order = np.argsort(-row, kind="stable")[:K]
        ids[i] = order
        top[i] = row[order]
        lse[i] = row_logsumexp(row)
        for r in range(K):
            logp[i, r] = np.float32(float(top[i, r]) - lse[i])
    return TopK(K, ids, top, lse, logp)


def total_nodes(L: int, K: int) -> int:
    """Number of distinct rank tuples of length 1..L over K ranks: Σ_{d=1..L} K^d."""
    return sum(K ** d for d in range(1, L + 1))


def finite_nodes(tk: TopK) -> int:
    """Number of rank tuples whose σ is finite: Σ_d Π_{i<d} (finite logp among row i's top K)."""
    f = np.isfinite(tk.logp).sum(axis=1)
    total, prod = 0, 1
    for i in range(tk.logp.shape[0]):
        prod *= int(f[i])
        total += prod
    return total


def build_tree(logits: np.ndarray, budget: int, stop_at_neginf: bool = False) -> dict:
    """The tree of Algorithm 1. With stop_at_neginf=False (the spec read literally) nodes with σ = −inf are
    popped like any other once nothing finite is left, and the sibling after a −inf node gets
    σ − (−inf) + (−inf) = NaN, ordered however heapq orders NaN. With stop_at_neginf=True the build also
    stops when the best σ left is −inf (zero-probability prefixes are never added); the finite-σ nodes
    and their order are the same either way."""
    logits = np.asarray(logits)
    tk = topk_logp(logits, budget)
    L, V = logits.shape
    K = tk.K
    lp = [[float(v) for v in row] for row in tk.logp]  # float32 values widened to float64 exactly

    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = [-1]
    ranks: list[int] = []
    scores: list[float] = []
    rhos: list[tuple] = [()]

    heap: list[tuple] = [(-lp[0][0], (0,), 0, lp[0][0])]
    while heap and len(tokens) < budget:
        if stop_at_neginf and heap[0][3] == -math.inf:
            break  # heap[0] holds the largest σ; NaN never arises before the first −inf pop
        _, rho, parent, sigma = heapq.heappop(heap)
        idx = len(tokens) + 1
        d, r = len(rho), rho[-1]
        tokens.append(int(tk.ids[d - 1, r]))
        depths.append(d)
        parents.append(parent)
        ranks.append(r)
        scores.append(sigma)
        rhos.append(rho)
        if r + 1 < K:
            s = sigma - lp[d - 1][r] + lp[d - 1][r + 1]
            heapq.heappush(heap, (-s, rho[:-1] + (r + 1,), parent, s))
        if d < L:
            s = sigma + lp[d][0]
            heapq.heappush(heap, (-s, rho + (0,), idx, s))

    n = len(tokens)
    visible: list[list[int]] = [[0]]
    for i in range(1, n + 1):
        visible.append(visible[parents[i]] + [i])  # parents[i] < i and rows are increasing, so this stays sorted

    return {"budget": int(budget), "positions": int(L), "vocab": int(V), "n_nodes": n,
            "tokens": tokens, "depths": depths, "parents": parents, "ranks": ranks, "scores": scores,
            "visible": visible}


def rank_tuples(parents: list[int], ranks: list[int]) -> list[tuple]:
    """Rank tuple of every node (index 0 = root = ()), rebuilt from parents + ranks."""
    rhos: list[tuple] = [()]
    for i in range(1, len(parents)):
        rhos.append(rhos[parents[i]] + (ranks[i - 1],))
    return rhos


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} LOGITS.safetensors BUDGET", file=sys.stderr)
        return 2
    from safetensors.numpy import load_file
    logits = load_file(argv[1])["logits"]
    print(json.dumps(build_tree(logits, int(argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
