"""Server flags reported as started (issue 25.3/25.4): an in-process server (cheap) started with them."""
from mega_async.server.cli import parse_args

from .conftest import get, post
from .server_inproc import InProcessServer


def test_memory_saver_and_custom_logit_processor_flags_are_reported_as_started(weights_root):
    """slime's external-engine check reads enable_memory_saver from /server_info (the old server always said
    true); SGLang's default is false and --enable-memory-saver sets it. With --enable-custom-logit-processor a
    processor is still not run (it is pickled code), and the refusal says that instead of 'not enabled'."""
    args = parse_args(["--model", str(weights_root / "v0"), "--enable-memory-saver", "--enable-custom-logit-processor"])
    assert args.enable_memory_saver and args.enable_custom_logit_processor
    assert not parse_args(["--model", "m"]).enable_memory_saver
    with InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root), enable_memory_saver=True,
                         enable_custom_logit_processor=True) as s:
        for path in ("/server_info", "/get_server_info"):
            st, si = get(s.address, path)
            assert st == 200 and si["enable_memory_saver"] is True and si["enable_custom_logit_processor"] is True
        st, out = post(s.address, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2},
                                                "custom_logit_processor": '{"callable": "00"}'})
        assert st == 400 and "unpickles nothing" in out["error"]["message"]
        st, out = post(s.address, "/generate", {"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 2, "custom_params": {"thinking_budget": 3, "note": [1, "a", None]}}})
        assert st == 200 and len(out["output_ids"]) == 2
