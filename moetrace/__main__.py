from moetrace.cli import main

main()
