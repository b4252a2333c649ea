"""``python -m bench NAME [options]`` (same as ``inferq bench``)."""

import typer

from bench.cli import bench


def main() -> None:
    typer.run(bench)


if __name__ == "__main__":
    main()
