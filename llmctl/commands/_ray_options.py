"""run-batch's Ray options (`--ray` and its sizing): the option record `RayFlags`.

Owns: the Ray flags' names and help (defaults quoted from `RayOptions`) and `ray_options`, which
turns them into `RayOptions` (None without --ray; a sizing flag without --ray is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from llmctl.batch.options import RayOptions
from llmctl.commands._options import default_of, given
from llmctl.errors import UsageError


def _opt(*names: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, show_default=False, rich_help_panel="Ray", **kw)


@dataclass(frozen=True)
class RayFlags:
    """Ray Data: --ray and its sizing."""

    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run on Ray Data: one engine per replica (an actor loading the model once); "
            "needs the ray extra (pip install 'llmctl\\[ray]').",
            rich_help_panel="Ray",
        ),
    ] = False
    ray_address: Annotated[
        Optional[str],
        _opt(
            "--ray-address",
            help="Ray cluster to join (auto, or HOST:PORT); default: a local cluster started "
            "and stopped by the command.",
        ),
    ] = None
    replicas: Annotated[
        Optional[int],
        _opt("--replicas", min=1, help="Engines to run" + default_of(RayOptions, "replicas") + "."),
    ] = None
    gpus_per_replica: Annotated[
        Optional[float],
        _opt(
            "--gpus-per-replica",
            min=0.0,
            help="GPUs each replica reserves" + default_of(RayOptions, "gpus_per_replica") + ".",
        ),
    ] = None
    cpus_per_replica: Annotated[
        Optional[float],
        _opt(
            "--cpus-per-replica",
            min=0.0,
            help="CPUs each replica reserves" + default_of(RayOptions, "cpus_per_replica") + ".",
        ),
    ] = None
    batch_rows: Annotated[
        Optional[int],
        _opt(
            "--batch-rows",
            min=1,
            help="Rows sent to a replica at a time" + default_of(RayOptions, "batch_rows") + ".",
        ),
    ] = None


def ray_options(a: RayFlags) -> RayOptions | None:
    """The Ray flags as `RayOptions`, or None without --ray."""
    sizing = given(
        address=a.ray_address,
        replicas=a.replicas,
        gpus_per_replica=a.gpus_per_replica,
        cpus_per_replica=a.cpus_per_replica,
        batch_rows=a.batch_rows,
    )
    if not a.ray:
        if sizing:
            flags = ", ".join("--" + k.replace("_", "-") for k in sizing)
            raise UsageError(f"{flags.replace('--address', '--ray-address')} only apply with --ray")
        return None
    return RayOptions(**sizing)
