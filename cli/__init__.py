"""The ``mmreplay`` command line.

Each command lives in its own module and is imported only when it runs. This module is
the one place where library errors become one line on stderr and an exit status.
"""

from __future__ import annotations

import errno
import importlib
import os
import select
import signal
import sys
import warnings
from typing import Any

import click

import mmreplay

#: command name -> (module under mmreplay.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "Collect, crash, resume, sample and export on a built-in environment."),
    "inspect": ("inspect", "Show a buffer's size, fill, episodes, leaves and storage (read-only)."),
    "export": ("export", "Export to minari, d4rl, d3rlpy, parquet, npz, csv, pt, zarr, hdf5 or lerobot."),
    "import": ("import_", "Create a store from a Minari dataset, a D4RL file, an npz or a LeRobot folder."),
    "convert": ("convert", "Copy a store to another backend, chunking, compression or capacity."),
    "sample": ("sample", "Print a few random rows."),
    "stats": ("stats", "Episode return / length statistics and per-leaf value ranges."),
    "plot": ("plot", "Plot episode returns and the episode length histogram to an image."),
    "view": ("view", "Draw frames as a GIF, an MP4 or a contact sheet (PNG), or write a Rerun recording."),
    "create": ("create", "Create an empty store from a JSON or YAML spec file."),
    "verify": ("verify", "Check a buffer's files against its metadata; exit 0 only if healthy."),
    "recover": ("recover", "Bring a damaged buffer back to its last consistent commit; say what was lost."),
    "push": ("push", "Publish a store to object storage (s3://) as a snapshot, sending what changed."),
    "pull": ("pull", "Download a store from object storage (s3://) into a new folder."),
    "torture": ("torture", "Kill writers with SIGKILL at random moments; check no committed step is lost."),
}

#: exit status per error class (the first match in this order wins)
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (mmreplay.NotABufferError, 3),
    (mmreplay.CorruptBufferError, 4),
    (mmreplay.UnsupportedFormatError, 4),
    (mmreplay.LockedError, 5),
    (mmreplay.ReadOnlyError, 6),  # a write the file system or the open mode does not allow
    (FileNotFoundError, 3),  # no bucket there too
    (PermissionError, 6),  # object storage's credentials refused too
    (mmreplay.RemoteUnreachableError, 8),  # object storage unreachable, or no answer in time
    (mmreplay.Error, 2),
    (FileExistsError, 2),
    (ImportError, 7),
    (OSError, 2),  # any other refusal of the file system (a folder where a file goes...)
]


def buffer_folder(path: str) -> str:
    """``path`` if it is a folder; a missing path or a file is no buffer (exit status 3)."""
    if not os.path.lexists(path):
        raise mmreplay.NotABufferError(f"{path}: no such folder")
    if not os.path.isdir(path):
        raise mmreplay.NotABufferError(f"{path}: not a folder (a buffer is a folder holding mmreplay.json)")
    return path


def is_group_folder(path: str) -> bool:
    """Whether ``path`` is a local group of stores (``mmreplay.create_group``)."""
    from mmreplay.group import is_group

    return not path.startswith("s3://") and is_group(path)


def open_source(path: str) -> Any:
    """The store at ``path`` opened read-only, or the group of stores there."""
    if is_group_folder(path):
        return mmreplay.open_group(path)
    return mmreplay.open(path, mode="r")


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (poll reports an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
        return module.command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            done = super().invoke(ctx)
            sys.stdout.flush()  # (output still buffered meets a closed pipe here, not at exit)
            return done
        except BrokenPipeError:
            if not stdout_reader_gone():
                raise
            # `mmreplay sample STORE | head -1`: end quietly, with the status a shell gives
            # a command that a closed pipe stopped; the interpreter's last flush goes nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(128 + signal.SIGPIPE)
        except click.exceptions.Exit:
            raise
        except click.UsageError as exc:  # a bad option or argument: one line, as for every mistake
            where = exc.ctx.command_path if exc.ctx is not None else "mmreplay"
            click.echo(f"Error: {exc.format_message()} (see '{where} -h')", err=True)
            ctx.exit(exc.exit_code)
        except click.ClickException:
            raise
        except click.exceptions.Abort:
            raise
        except Exception as exc:
            for cls, code in EXIT_CODES:
                if isinstance(exc, cls):
                    click.echo(f"Error: {error_line(exc)}", err=True)
                    ctx.exit(6 if getattr(exc, "errno", None) == errno.EROFS else code)
            raise


def error_line(exc: Exception) -> str:
    """The error's message; Python's ``[Errno 30] Read-only file system: 'x'`` as
    ``x: Read-only file system``, and a read lapped by a writer without the API's advice."""
    if isinstance(exc, mmreplay.OverwrittenError):
        return str(exc.by("the command"))
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None and exc.filename2 is None:
        return f"{os.fsdecode(exc.filename)}: {exc.strerror}"
    return str(exc)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mmreplay.__version__, prog_name="mmreplay")
@click.option(
    "--endpoint-url",
    default=None,
    metavar="URL",
    help="The S3-compatible endpoint of s3:// paths (else the AWS_ENDPOINT_URL environment variable).",
)
def main(endpoint_url: str | None) -> None:
    """mmreplay: a disk-persistent, memory-mapped replay store for RL.

    Wherever a command reads a store (inspect, verify, export, stats, sample) or writes
    an export, PATH may be an s3://bucket/prefix URL; credentials come from the AWS_*
    environment variables. inspect, verify, stats and export also take a group's folder
    (mmreplay.create_group): shard by shard, or all shards as one dataset."""
    if endpoint_url:
        os.environ["AWS_ENDPOINT_URL"] = endpoint_url
    warnings.showwarning = show_warning


def show_warning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    """A warning as one line, as errors are (no source line of mmreplay's or click's)."""
    click.echo(f"Warning: {message}", err=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
