"""Independent planning tasks run where the user says: in this process, on a
local process pool, or on a Dask cluster.

:func:`run_tasks` calls ``function(*args, task)`` for every task and yields
``(index, result)`` as each finishes: with ``workers`` 1 and no cluster, in
order in this process; with ``workers`` > 1, on a local pool of that many
spawned processes; with ``cluster`` (``"local"``: a Dask ``LocalCluster``
of ``workers`` single-threaded processes; or a scheduler's address,
``tcp://host:8786``), on Dask's workers. The function is pure, so the
results are the same wherever they run (tested).

Why Dask rather than Ray: the tasks are a flat list of independent
pure-Python calls with small results, which is what ``distributed``'s
futures do with no cluster runtime beyond Python processes; it installs as
pure-Python wheels (Ray ships a C++ runtime and a much larger install), and
its ``LocalCluster`` starts in a few seconds inside a test. It is an
optional extra (``pip install 'pipedejavu[cluster]'``), imported only when
a cluster is asked for.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipedejavu.core.problem import ProblemError

__all__ = ["run_tasks"]


def _dask_client(cluster: str, workers: int) -> tuple[Any, Any]:
    """``(client, local cluster or None)`` for ``cluster``."""
    try:
        import distributed  # (optional: only for --cluster)
    except ImportError:
        raise ProblemError(
            "--cluster needs Dask's distributed: pip install 'pipedejavu[cluster]'"
        ) from None
    if cluster == "local":
        local = distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
        )
        return distributed.Client(local), local
    try:
        return distributed.Client(cluster, timeout="10s"), None
    except (OSError, TimeoutError) as error:
        raise ProblemError(
            f"--cluster {cluster[:80]}: cannot reach the Dask scheduler ({error})"
        ) from None


def run_tasks(
    function: Callable[..., Any],
    args: tuple,
    tasks: Sequence[Any],
    *,
    workers: int = 1,
    cluster: str | None = None,
) -> Iterator[tuple[int, Any]]:
    """``(index, function(*args, tasks[index]))`` for every task, as each
    finishes (module docstring).

    Raises:
        ProblemError: ``workers`` not a whole number >= 1; a cluster that
            cannot be reached or Dask not installed.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ProblemError(f"workers must be an integer >= 1, got {workers!r}")
    if cluster is not None:
        client, local = _dask_client(cluster, workers)
        try:
            futures = {client.submit(function, *args, task, pure=False): i
                       for i, task in enumerate(tasks)}  # fmt: skip
            import distributed

            for future in distributed.as_completed(futures):
                yield futures[future], future.result()
        finally:
            client.close()
            if local is not None:
                local.close()
        return
    if workers == 1:
        for i, task in enumerate(tasks):
            yield i, function(*args, task)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {
            pool.submit(function, *args, task): i for i, task in enumerate(tasks)
        }
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()
