"""Run configuration: the arguments of :func:`weightstream.configure`, typed and validated.

The configuration is set once per run (as in the reference API, where one
process drives one run) and kept in the run context (Note [run context] in
weightstream/context.py): ``configure`` and ``current_config`` live there. This
module only defines and checks it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from weightstream.common.schema import MASTER_DTYPE_HINT, check, setting


@dataclass(frozen=True)
class RunConfig:
    """Cluster and run settings (seed 003, ``cstorch.configure``)."""

    model_dir: str | os.PathLike = "./"
    compile_dir: str | os.PathLike | None = None
    compile_only: bool = False
    validate_only: bool = False
    checkpoint_steps: int = setting(0, ge=0, doc="Checkpoint every this many steps.")
    num_csx: int = setting(1, ge=1, doc="Compute systems in the run.")
    max_wgt_servers: int = setting(24, ge=1, doc="The most weight servers to use.")
    mount_dirs: list[str] | None = None
    python_paths: list[str] | None = None
    transfer_processes: int = setting(5, ge=1, doc="Processes that move data.")
    num_workers_per_csx: int = setting(1, ge=0, doc="Input workers per compute system.")
    job_labels: list[str] | None = None
    max_act_per_csx: int = setting(1, ge=1, doc="Activation servers per compute system.")
    # Keys the reference accepts that have no meaning on a local machine
    # (mgmt_address, credentials_path, ...): kept so code passes them unchanged.
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            check(self)  # the params file's mechanism (common/schema.py)
        except (TypeError, ValueError) as e:
            raise type(e)(f"configure(): {e}") from None
        if self.compile_only and self.validate_only:
            raise ValueError(
                "configure(): compile_only and validate_only are mutually exclusive; "
                "set at most one of them to True."
            )
        for label in self.job_labels or ():
            if "=" not in label:
                raise ValueError(f"configure(): job label {label!r} is not of the form key=value.")


_ACCEPTED_EXTRA = frozenset(
    {"mgmt_address", "mgmt_namespace", "credentials_path", "debug_args", "log_initialization"}
)


def parse_configure_arguments(**kwargs) -> RunConfig:
    """The :class:`RunConfig` of ``configure(**kwargs)``, checked; it sets nothing.

    Takes the keyword arguments of the reference ``cstorch.configure``.
    Arguments that only address a remote cluster (``mgmt_address`` and the
    like) are accepted and kept in ``extra``; any other unknown one is a
    TypeError naming the nearest valid ones.
    """
    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"extra"}
    known = {k: v for k, v in kwargs.items() if k in fields}
    extra = {k: v for k, v in kwargs.items() if k not in fields}
    unknown = sorted(set(extra) - _ACCEPTED_EXTRA)
    if "master_dtype" in unknown:
        raise TypeError(f"configure(): {MASTER_DTYPE_HINT}")
    if unknown:
        import difflib

        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(fields | _ACCEPTED_EXTRA), n=3)
            hints.append(f"{key!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise TypeError(
            f"configure() got unknown argument(s): {', '.join(hints)}. "
            f"Valid arguments: {', '.join(sorted(fields))}. The weight-streaming "
            "options (update_in_backward, overlap_updates, store, prefetch_depth, ...) are "
            'keywords of cstorch.compile(model, backend="wse_ws", ...).'
        )
    return RunConfig(**known, extra=extra)
