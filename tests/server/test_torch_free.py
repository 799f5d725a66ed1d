"""The HTTP, detokenizer and data-parallel launcher processes never load torch (nor transformers or
xgrammar, which import it): they use treespec.tokenizer, and only the scheduler process holds the model."""

import subprocess
import sys

CODE = ("import treespec.server.detokenizer, treespec.server.http_server, treespec.server.tokenizer_manager, "
        "treespec.server.openai_api, treespec.server.dp_launcher; import sys; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules); "
        "assert not heavy, heavy")


def test_http_and_detokenizer_modules_import_no_torch():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
