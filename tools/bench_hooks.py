"""What Canzona's bucket-group hooks add to every iteration: the wrappers around Megatron's
``start_grad_sync`` and ``finish_grad_sync`` (``canzona_patches.integration.early_gather``),
timed around a method that does nothing, per bucket group and call.

    python tools/bench_hooks.py            # a table, microseconds per call

Rows: a bucket group with no Canzona listener (every run), one whose dispatch is held and
released by ``--canzona-matrices-reduce-first`` (hold, then the release inside the finish), and
one with the reduce order on but not held (a matrix bucket group: dispatched, counted). Each
bucket group passes one dispatch and one finish per iteration.
"""

from __future__ import annotations

import timeit
from types import SimpleNamespace

from canzona_patches.integration import early_gather
from megatron.canzona.cli import ArgumentParser, at_least


class _Group:
    """What the wrappers read of a bucket group (Megatron's attributes, none of its work)."""

    grad_reduce_handle = None
    is_first_batch = False
    grad_reduce_finished = False
    ddp_config = SimpleNamespace(overlap_grad_reduce=True)

    def start_grad_sync(self, *args, **kwargs) -> None:
        start(self, *args, **kwargs)


def _dispatch(group: _Group) -> None:  # Megatron's start_grad_sync, less its work
    group.grad_reduce_handle = object()


def _finish(group: _Group) -> None:  # Megatron's finish_grad_sync, less its work
    group.grad_reduce_handle = None


start = early_gather.announcing_dispatched_grads(_dispatch, None)
finish = early_gather.announcing_reduced_grads(_finish, None)


def per_iteration_us(group: _Group, number: int) -> float:
    """Microseconds of one dispatch and one finish of ``group`` through the wrappers, less the
    bare methods'."""
    wrapped = timeit.timeit(lambda: (start(group), finish(group)), number=number)
    bare = timeit.timeit(lambda: (_dispatch(group), _finish(group)), number=number)
    return 1e6 * (wrapped - bare) / number


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--number", type=at_least(1), default=200_000, help="calls timed per row")
    args = p.parse_args(argv)
    plain, held, matrix = _Group(), _Group(), _Group()
    order = early_gather.order_matrices_first([SimpleNamespace(bucket_groups=[matrix, held])], {matrix})
    rows = {"no listener (every run)": per_iteration_us(plain, args.number),
            "reduce order on, a matrix bucket group": per_iteration_us(matrix, args.number)}
    order.pending = {id(matrix)}  # a matrix bucket group still to come: the other one is held
    rows["reduce order on, held and released"] = per_iteration_us(held, args.number)
    assert order.held_count > 0, "the held row held nothing"
    print(f"{'bucket group':<42} {'µs per iteration (dispatch + finish)':>38}")
    for name, us in rows.items():
        print(f"{name:<42} {us:>38.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
