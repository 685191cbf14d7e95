from toolchain.cli.main import main

main()
