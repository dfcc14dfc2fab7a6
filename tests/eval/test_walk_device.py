"""eval/engine/walk.py: the device walk equals the sequential child-map walk; compaction keeps exactly the path."""

from __future__ import annotations

import torch

from eval.engine.round_record import parse_record
from eval.engine.tree import Tree, build_tree
from eval.engine.verify import ancestor_table
from eval.engine.walk import compact_rows, target_choices, walk_tree, walk_tree_reference


def random_tree(gen: torch.Generator, n: int, L: int, V: int) -> Tree:
    """A random tree in THE layout: parent < child, depth <= L, distinct tokens among siblings (n is capped
    by what fits: at most V children per node)."""
    parents, depths, tokens = [0], [0], [int(torch.randint(V, (1,), generator=gen))]
    used: dict[int, set] = {}
    while len(parents) < n + 1:
        open_nodes = [p for p in range(len(parents)) if depths[p] < L and len(used.get(p, ())) < V]
        if not open_nodes:
            break
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        free = [t for t in range(V) if t not in used.setdefault(p, set())]
        t = free[int(torch.randint(len(free), (1,), generator=gen))]
        used[p].add(t)
        parents.append(p)
        depths.append(depths[p] + 1)
        tokens.append(t)
    as_t = lambda x: torch.tensor(x, dtype=torch.long)
    return Tree(as_t(tokens), as_t(parents), as_t(depths), len(parents) - 1, L, "tree")


def test_device_walk_equals_sequential_walk_on_thousands_of_random_trees():
    gen = torch.Generator().manual_seed(0)
    deep = 0
    for trial in range(3000):
        L = int(torch.randint(1, 16, (1,), generator=gen))
        V = int(torch.randint(2, 9, (1,), generator=gen))
        n = int(torch.randint(0, 40, (1,), generator=gen))
        tree = random_tree(gen, n, L, V)
        # the target usually picks one of the node's children, so walks go deep and through siblings
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        kids = [[tokens[i] for i in range(1, len(tokens)) if parents[i] == p] for p in range(len(tokens))]
        choices = []
        for p in range(len(tokens)):
            if kids[p] and float(torch.rand((), generator=gen)) < 0.85:
                choices.append(kids[p][int(torch.randint(len(kids[p]), (1,), generator=gen))])
            else:
                choices.append(int(torch.randint(V, (1,), generator=gen)))
        path, bonus = walk_tree_reference(tokens, parents, choices)
        # both forms of the ancestor-AND: pointer jumping, and the mask's ancestor table
        table_walk = walk_tree(tree, torch.tensor(choices), ancestor_table(tree.parents, L))
        walk = walk_tree(tree, torch.tensor(choices))
        assert [int(table_walk.accepted), int(table_walk.bonus)] + table_walk.path.tolist() == \
            [int(walk.accepted), int(walk.bonus)] + walk.path.tolist()
        a = int(walk.accepted)
        assert a == len(path) - 1
        assert walk.path[: a + 1].tolist() == path and walk.path[a + 1:].eq(0).all()
        assert int(walk.bonus) == bonus and int(walk.last) == path[-1]
        record = parse_record(walk.host_record(tree).tolist(), L)  # the record the round reads back
        assert (record.accepted, record.bonus, record.depth) == (a, bonus, max(tree.depths.tolist()))
        assert record.path == path and record.accepted_tokens == [tokens[i] for i in path[1:]]
        assert record.contiguous == (path == list(range(a + 1)))
        deep += a >= 3
    assert deep > 300  # the test exercised deep acceptances


def test_walk_never_reads_a_sibling_as_a_successor():
    # root(9) -> 1:'a'(5) and 2:'b'(6); 1 -> 3:'c'(7). Target picks b at root, c after b: must stop at node 2.
    tree = Tree(torch.tensor([9, 5, 6, 7]), torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 1, 2]), 3, 2, "tree")
    walk = walk_tree(tree, torch.tensor([6, 7, 7, 1]))
    assert int(walk.accepted) == 1 and walk.path.tolist() == [0, 2, 0] and int(walk.bonus) == 7


def test_compaction_moves_the_accepted_rows_to_the_front_of_the_tail():
    past = 4
    kv = torch.arange(2 * 3 * 12 * 2, dtype=torch.float32).view(2, 3, 12, 2)
    before = kv.clone()
    keep = torch.tensor([0, 2, 5, 6])
    compact_rows(kv, 2, past, keep)
    assert torch.equal(kv[:, :, :past], before[:, :, :past])
    assert torch.equal(kv[:, :, past:past + 4], before[:, :, past + keep])


def test_sampled_choices_follow_the_softmax_and_use_one_uniform_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0], [5.0, 0.0, 0.0]])
    u = torch.tensor([0.0, 0.999999])
    assert target_choices(logits, 0.0).tolist() == [2, 0]
    assert target_choices(logits, 1.0, u).tolist() == [0, 2]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 6, generator=gen).expand(40000, 6)
    draws = target_choices(rows, 0.7, torch.rand(40000, generator=gen))
    freq = torch.bincount(draws, minlength=6).double() / 40000
    assert torch.allclose(freq, torch.softmax(rows[0].double() / 0.7, -1), atol=0.01)


def test_walk_on_a_built_tree_accepts_the_path_the_target_would_generate():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 20, generator=gen) * 3
    tree = build_tree(logits, 32, 11)
    # the "target" prefers, at every node, its highest-token child: the walk must follow exactly those children
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    choices = []
    for p in range(tree.size):
        kids = [tokens[i] for i in range(1, tree.size) if parents[i] == p]
        choices.append(max(kids) if kids else 19)
    path, bonus = walk_tree_reference(tokens, parents, choices)
    walk = walk_tree(tree, torch.tensor(choices))
    assert walk.path[: len(path)].tolist() == path and int(walk.bonus) == bonus and len(path) > 2

