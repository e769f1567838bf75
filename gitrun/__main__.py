"""``python -m gitrun`` runs the CLI."""

from gitrun.entry import main

main()
