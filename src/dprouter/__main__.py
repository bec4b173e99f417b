from dprouter.cli import main

main()
