"""``python -m gitrun`` runs the CLI."""

from gitrun.cli import main

main()
