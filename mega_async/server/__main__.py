"""`python -m mega_async.server --model DIR --host 127.0.0.1 --port N`."""
from mega_async.server.cli import main

main()
