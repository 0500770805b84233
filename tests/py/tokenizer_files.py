"""Where the tests find the real tokenizer tarballs (qwen3/llama3/llama2.tar.xz, CONTRIBUTING.md):
$KVS_TOKENIZERS, then shared/tokenizers beside the checkout (where CI keeps them), then
tests/data/tokenizers (Qwen3's is committed, Apache-2.0; Meta's licences keep the Llama files
out). The same order as tests/unit/test_util.h's kvs_test_tokenizer_tarball."""
import os

ROOT = os.environ.get("KVS_ROOT", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PLACES = "$KVS_TOKENIZERS, ../shared/tokenizers or tests/data/tokenizers (CONTRIBUTING.md)"


def tarball(name):
    """The path of <name>.tar.xz, or None when no place has it."""
    dirs = [os.environ.get("KVS_TOKENIZERS") or None, os.path.join(ROOT, "..", "shared", "tokenizers"),
            os.path.join(ROOT, "tests", "data", "tokenizers")]
    for d in dirs:
        if d and os.access(os.path.join(d, name + ".tar.xz"), os.R_OK):
            return os.path.join(d, name + ".tar.xz")
    return None


def required():
    """KVS_REQUIRE_TOKENIZERS=1 (set by .ci/run): a missing tarball is a failure, not a skip."""
    return os.environ.get("KVS_REQUIRE_TOKENIZERS") == "1"
