from envhub.cli import main

main()
