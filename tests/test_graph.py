"""trace_tools.graph: the one topological order, longest path and descendant walk of convert, validate and report."""
from trace_tools.graph import children_of, descendants, longest_path, topological_order

# 0 -> 1 -> 3 and 0 -> 2 -> 3, with 2 the heavier branch; 4 stands alone
DIAMOND = [[], [0], [0], [1, 2], []]
WEIGHTS = [1, 5, 7, 2, 3]


def test_every_node_comes_after_its_parents_lowest_priority_first_among_the_ready():
    assert topological_order(DIAMOND) == [0, 4, 1, 2, 3]
    assert topological_order(DIAMOND, priority=[9, 2, 1, 0, 0]) == [4, 0, 2, 1, 3]


def test_nodes_on_a_cycle_and_after_it_are_left_out_of_the_order():
    assert topological_order([[2], [0], [1], [2], []]) == [4]


def test_longest_path_runs_through_the_heavier_branch():
    finish, best_parent = longest_path(DIAMOND, WEIGHTS)
    assert finish == [1, 6, 8, 10, 3] and best_parent == [-1, 0, 0, 2, -1]


def test_a_chain_of_a_hundred_thousand_nodes_needs_no_recursion():
    chain = [[]] + [[i] for i in range(10 ** 5 - 1)]
    assert longest_path(chain, [1] * len(chain))[0][-1] == 10 ** 5
    assert len(descendants(children_of(chain), [0])) == 10 ** 5 - 1


def test_descendants_are_everything_that_depends_on_the_start():
    assert descendants(children_of(DIAMOND), [1]) == {3}
    assert descendants(children_of(DIAMOND), [0]) == {1, 2, 3}
