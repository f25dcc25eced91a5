from launcher.cli import run

run()
