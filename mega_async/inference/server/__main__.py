"""`python -m mega_async.inference.server --model DIR --host 127.0.0.1 --port N`."""
from mega_async.inference.server.cli import main

main()
