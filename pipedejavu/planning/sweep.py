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
    tasks: Sequence[Any] | Callable[[int], Any],
    *,
    workers: int = 1,
    cluster: str | None = None,
    count: int | None = None,
) -> Iterator[tuple[int, Any]]:
    """``(index, function(*args, task))`` for every task, as each finishes
    (module docstring). ``tasks``: a sequence, or ``task(index)`` for
    ``count`` of them, called as each is sent (never more in flight than the
    workers can run, so a task built late sees every result yielded before
    it: a capacity question's cutoffs).

    Raises:
        ProblemError: ``workers`` not a whole number >= 1; a cluster that
            cannot be reached or Dask not installed.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ProblemError(f"workers must be an integer >= 1, got {workers!r}")
    if callable(tasks):
        task_at, total = tasks, int(count or 0)
    else:
        task_at, total = tasks.__getitem__, len(tasks)
    if cluster is not None:
        client, local = _dask_client(cluster, workers)
        try:
            import distributed

            slots = max(1, sum(client.nthreads().values()))
            futures: dict[Any, int] = {}
            done = distributed.as_completed()
            for i in range(min(slots, total)):
                future = client.submit(function, *args, task_at(i), pure=False)
                futures[future] = i
                done.add(future)
            sent = len(futures)
            for future in done:
                index = futures.pop(future)
                result = future.result()
                yield index, result
                if sent < total:
                    nxt = client.submit(function, *args, task_at(sent), pure=False)
                    futures[nxt] = sent
                    done.add(nxt)
                    sent += 1
        finally:
            client.close()
            if local is not None:
                local.close()
        return
    if workers == 1:
        for i in range(total):
            yield i, function(*args, task_at(i))
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        running: dict[Any, int] = {}
        sent = 0
        while sent < total or running:
            while sent < total and len(running) < workers:
                running[pool.submit(function, *args, task_at(sent))] = sent
                sent += 1
            finished, _ = concurrent.futures.wait(
                running, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in sorted(finished, key=running.__getitem__):
                yield running.pop(future), future.result()
