import os
from tests.test_howto_table3 import *  # noqa
from tests.s3server import unique_bucket
from tests.raycluster import a2_env

def test_first_blocks(tmp_path, s3_endpoint):
    laptop = laptop_checkout(tmp_path / "a2tune")
    coco_downloads(laptop / "data" / "coco")
    bucket = unique_bucket(s3_endpoint, "a2-howto")
    env = {**a2_env({k: v for k, v in os.environ.items() if not k.startswith("RAY_")}), "AWS_ENDPOINT_URL": s3_endpoint}
    blocks = [b for b in page_blocks(PAGE.read_text()) if b["runs"]]
    for i, b in enumerate(blocks[:3]):
        out = run_block(i, script(b["lines"], bucket), laptop, env, tmp_path / "log")
        print(out[-1500:])
