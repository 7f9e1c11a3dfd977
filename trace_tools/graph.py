"""Walks over a dependency graph of nodes 0..n-1 given by each node's parents: topological order, longest path,
descendants. All iterative: real traces have 10^5-10^6 nodes in one dependency chain."""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable, Sequence


def children_of(parents: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each node's children (one entry per edge, so a repeated parent counts twice on both sides)."""
    children: list[list[int]] = [[] for _ in parents]
    for i, ps in enumerate(parents):
        for p in ps:
            children[p].append(i)
    return children


def topological_order(parents: Sequence[Sequence[int]], priority: Sequence | None = None) -> list[int]:
    """Every node after all of its parents (Kahn's algorithm): among the ready nodes, the lowest `priority` first
    when given, else the first ready. Nodes on a dependency cycle, and all that depend on one, are left out, so
    len(order) < len(parents) says there is a cycle."""
    children = children_of(parents)
    waiting = [len(ps) for ps in parents]
    order: list[int] = []
    if priority is None:
        ready = deque(i for i, w in enumerate(waiting) if w == 0)
        pop, push = ready.popleft, ready.append
    else:
        heap = [(priority[i], i) for i, w in enumerate(waiting) if w == 0]
        heapq.heapify(heap)
        pop = lambda: heapq.heappop(heap)[1]  # noqa: E731
        push = lambda i: heapq.heappush(heap, (priority[i], i))  # noqa: E731
        ready = heap
    while ready:
        i = pop()
        order.append(i)
        for c in children[i]:
            waiting[c] -= 1
            if waiting[c] == 0:
                push(c)
    return order


def longest_path(parents: Sequence[Sequence[int]], weights: Sequence[float],
                 order: Sequence[int] | None = None) -> tuple[list[float], list[int]]:
    """(finish, best_parent): finish[i] = weights[i] + the latest finish among i's parents (the end of the longest
    weighted chain ending in i, as a simulator that runs every node once its parents are done would time it), and
    the parent that chain comes through (-1 for none; the first of equals). Nodes not in `order` (default: the
    topological order, which leaves out cycles) keep 0."""
    finish: list = [0] * len(parents)  # the weights' type: int durations give int finish times
    best_parent = [-1] * len(parents)
    for i in topological_order(parents) if order is None else order:
        start, best = 0, -1
        for p in parents[i]:
            if best < 0 or finish[p] > start:
                start, best = finish[p], p
        finish[i], best_parent[i] = start + weights[i], best
    return finish, best_parent


def descendants(children: Sequence[Iterable[int]], start: Iterable[int]) -> set[int]:
    """Every node that depends on one of `start`, directly or not (`start` itself only when on a cycle)."""
    seen: set[int] = set()
    stack = list(start)
    while stack:
        for c in children[stack.pop()]:
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen
