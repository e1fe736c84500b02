"""Image-text rows: both schemas, every kind of bad input skipped with file:line and counted, the limit."""
import base64
import io
import json
import logging

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from conftest import REPO
from data_tools.make_tiny_model import make_tiny_model
from slime.config import DataConfig
from slime.data.prompts import PromptSource, load_prompts
from slime.multimodal.processor import VLProcessor
from slime.utils.net import free_port

Q = "What colour?"


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("vl") / "m", arch="qwen2_vl", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    return path, tok, VLProcessor(str(path), tok)


def png(path, size=(60, 50), colour=(200, 30, 30), mode="RGB"):
    Image.new(mode, size, colour if mode == "RGB" else 7).save(path)
    return path.name


def rows_file(tmp_path, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_both_schemas_give_the_same_prompt(tmp_path, vl):
    _, tok, proc = vl
    name = png(tmp_path / "a.png")
    flat = {"prompt": f"<image>{Q}", "images": [name], "label": "red"}
    chat = {"messages": [{"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": Q}]}],
            "label": "red"}
    data_uri = "data:image/png;base64," + base64.b64encode((tmp_path / name).read_bytes()).decode()
    uri = {"messages": [{"role": "user", "content": [{"type": "image", "image": data_uri},
                                                     {"type": "text", "text": Q}]}], "label": "red"}
    file_url = {"prompt": f"<image>{Q}", "images": [f"file://{tmp_path / name}"], "label": "red"}
    openai = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri}},
                                                        {"type": "text", "text": Q}]}], "label": "red"}
    prompts, report = load_prompts(DataConfig(path=str(rows_file(tmp_path, [flat, chat, uri, file_url, openai]))),
                                   tok, processor=proc)
    assert not report.skipped and len(prompts) == 5
    assert all(p.images for p in prompts)  # OpenAI's image_url part is an image (it was dropped: text-only)
    assert all(p.prompt_ids == prompts[0].prompt_ids for p in prompts)
    n_tokens = proc.image_tokens(60, 50)
    assert prompts[0].prompt_ids.count(proc.image_token_id) == n_tokens == 4  # 56x56 after resizing: 2x2 tokens
    assert tok.decode(prompts[0].prompt_ids).startswith("<user><|vision_start|><|image_pad|>")


def test_an_image_placeholder_in_a_turns_text_is_an_image_as_in_the_flat_form(tmp_path, vl, tiny_model, caplog):
    """LLaMA-Factory's and ShareGPT's form, "<image>" in a message's string content with an images list: every such
    row was skipped ("'messages' has 0 image part(s)"), and without the list the placeholder loaded as literal
    text where the flat form skips the row. Now it is an image there, as in the flat form; on a text model (no
    images) it stays text."""
    _, tok, proc = vl
    name = png(tmp_path / "a.png")
    flat = {"prompt": f"<image>{Q}", "images": [name], "label": "red"}
    sharegpt = {"messages": [{"role": "user", "content": f"<image>{Q}"}], "images": [name], "label": "red"}
    unfilled = {"messages": [{"role": "user", "content": f"<image>{Q}"}], "label": "red"}
    with caplog.at_level(logging.WARNING):
        prompts, report = load_prompts(DataConfig(path=str(rows_file(tmp_path, [flat, sharegpt, unfilled])),
                                                  max_skipped_frac=1.0), tok, processor=proc)
    assert [p.index for p in prompts] == [0, 1] and prompts[1].prompt_ids == prompts[0].prompt_ids
    assert prompts[1].images == [name] and dict(report.skipped) == {"placeholder_mismatch": 1}
    assert "d.jsonl:3: skipped (placeholder_mismatch): 'messages' has 1 image part(s) or <image> placeholder(s)" \
        in caplog.text and "left the text of a message out" not in caplog.text
    text_tok = AutoTokenizer.from_pretrained(tiny_model)
    texts, _ = load_prompts(DataConfig(path=str(rows_file(tmp_path, [unfilled]))), text_tok)
    assert f"<image>{Q}" in texts[0].prompt_text


def test_pixels_are_made_when_drawn_and_match_the_prompt(tmp_path, vl):
    _, tok, proc = vl
    rows = [{"prompt": f"<image>{Q} {k}", "images": [png(tmp_path / f"{k}.png", size=(30 + 20 * k, 40))],
             "label": "red"} for k in range(4)]
    source = PromptSource(DataConfig(path=str(rows_file(tmp_path, rows)), shuffle=False), tok, batch_size=4,
                          dp_rank=0, dp_size=1, seed=0, processor=proc)
    assert all(p.mm is None for p in source.prompts)  # no pixels held for the whole file
    drawn = source.next_batch()
    for p in drawn:
        tokens = int((p.mm.image_grid_thw.prod(-1) // 4).sum())
        assert tokens == p.prompt_ids.count(proc.image_token_id)
        assert p.mm.pixel_values.shape[0] == int(p.mm.image_grid_thw.prod(-1).sum())
        w, h = p.mm.images[0].size  # the size SGLang is given keeps its processor from resizing again
        assert proc.processed_size(w, h) == (w, h)


def test_exif_orientation_is_applied(tmp_path, vl):
    from slime.multimodal.images import read_image

    img = Image.new("RGB", (40, 20), (0, 0, 255))
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    img.save(tmp_path / "r.jpg", exif=exif.tobytes())
    assert read_image("r.jpg", tmp_path, max_pixels=10**6).size == (20, 40)


class _Refusing:
    """A loopback address with nothing listening: fetching from it fails at once."""
    url = f"http://127.0.0.1:{free_port()}/img.png"


def test_every_bad_input_is_skipped_named_and_counted(tmp_path, vl, caplog):
    _, tok, proc = vl
    good = png(tmp_path / "good.png")
    (tmp_path / "trunc.png").write_bytes((tmp_path / good).read_bytes()[:60])
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    Image.new("I;16", (30, 30)).save(tmp_path / "deep.png")
    png(tmp_path / "big.png", size=(400, 400))
    rows = [
        {"prompt": f"<image>{Q}", "images": [good], "label": "red"},                       # line 1: fine
        {"prompt": f"<image>{Q}", "images": ["nowhere.png"], "label": "red"},              # 2 missing
        {"prompt": f"<image>{Q}", "images": ["trunc.png"], "label": "red"},                # 3 truncated
        {"prompt": f"<image>{Q}", "images": ["junk.png"], "label": "red"},                 # 4 not an image
        {"prompt": f"<image>{Q}", "images": ["deep.png"], "label": "red"},                 # 5 16-bit mode
        {"prompt": f"<image><image>{Q}", "images": [good], "label": "red"},                # 6 2 placeholders, 1 image
        {"prompt": f"<image>{Q}", "images": [_Refusing.url], "label": "red"},              # 7 fetch fails
        {"prompt": f"<image>{Q}", "images": ["big.png"], "label": "red"},                  # 8 over max_image_pixels
        {"prompt": Q, "label": "red"},                                                     # 9 text-only: fine
    ]
    path = rows_file(tmp_path, rows)
    cfg = DataConfig(path=str(path), max_image_pixels=300 * 300, max_skipped_frac=1.0)
    with caplog.at_level(logging.WARNING):
        prompts, report = load_prompts(cfg, tok, processor=proc)
    assert [p.index for p in prompts] == [0, 8]
    assert dict(report.skipped) == {"missing_image": 1, "corrupt_image": 2, "unsupported_mode": 1,
                                    "placeholder_mismatch": 1, "fetch_failed": 1, "too_large": 1}
    for line, reason in ((2, "missing_image"), (3, "corrupt_image"), (4, "corrupt_image"), (5, "unsupported_mode"),
                         (6, "placeholder_mismatch"), (7, "fetch_failed"), (8, "too_large")):
        assert f"d.jsonl:{line}: skipped ({reason})" in caplog.text, (line, reason)
    with pytest.raises(ValueError, match=r"7 of 9 rows are bad .* data.max_skipped_frac=0.5"):
        load_prompts(DataConfig(path=str(path), max_image_pixels=300 * 300, max_skipped_frac=0.5), tok,
                     processor=proc)


def test_a_decompression_bomb_is_refused_before_decoding(tmp_path, vl):
    from slime.multimodal.images import ImageError, read_image

    Image.new("L", (3000, 3000)).save(tmp_path / "bomb.png")  # 9 Mpx of zeros: a few KB on disk
    assert (tmp_path / "bomb.png").stat().st_size < 100_000
    with pytest.raises(ImageError) as e:
        read_image("bomb.png", tmp_path, max_pixels=1_000_000)
    assert e.value.reason == "too_large" and "3000x3000" in str(e.value)


def test_headers_pillow_refuses_with_other_errors_are_corrupt_images_and_premultiplied_modes_load(tmp_path, vl):
    """Pillow refuses some bad headers with a plain ValueError (a truncated PPM header): it escaped the loader,
    one bad row stopping the run instead of being skipped. And "La", a supported mode, failed its RGB conversion."""
    from slime.multimodal.images import ImageError, read_image

    (tmp_path / "cut.ppm").write_bytes(b"P6\n32")
    (tmp_path / "garbled.ppm").write_bytes(b"P6\n3x 24\n255\n")
    for name in ("cut.ppm", "garbled.ppm"):
        with pytest.raises(ImageError, match=f"{name} is not a readable image") as e:
            read_image(name, tmp_path, max_pixels=10**6)
        assert e.value.reason == "corrupt_image"
    path = rows_file(tmp_path, [{"prompt": f"<image>{Q}", "images": [png(tmp_path / "good.png")], "label": "red"},
                                {"prompt": f"<image>{Q}", "images": ["cut.ppm"], "label": "red"}])
    prompts, report = load_prompts(DataConfig(path=str(path), max_skipped_frac=1.0), vl[1], processor=vl[2])
    assert len(prompts) == 1 and dict(report.skipped) == {"corrupt_image": 1}
    for mode in ("La", "RGBa"):  # alpha 0 everywhere: white, as the other modes with alpha
        rgb = read_image(Image.new(mode, (30, 20)), tmp_path, max_pixels=10**6)
        assert rgb.mode == "RGB" and rgb.getpixel((3, 3)) == (255, 255, 255), mode


def test_image_rows_need_an_image_text_model(tmp_path, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    png(tmp_path / "a.png")
    path = rows_file(tmp_path, [{"prompt": f"<image>{Q}", "images": ["a.png"], "label": "x"}])
    with pytest.raises(ValueError, match=r"d.jsonl:1: the row has images but model.path is a text-only model"):
        load_prompts(DataConfig(path=str(path)), tok)
    path = rows_file(tmp_path, [{"prompt": Q, "images": ["a.png"], "label": "x"}])  # no placeholder: the same
    with pytest.raises(ValueError, match=r"d.jsonl:1: the row has images but model.path is a text-only model"):
        load_prompts(DataConfig(path=str(path)), tok)


def test_parquet_with_an_image_feature(tmp_path, vl):
    import datasets

    _, tok, proc = vl
    buf = io.BytesIO()
    Image.new("RGB", (60, 50), (10, 200, 10)).save(buf, format="PNG")
    ds = datasets.Dataset.from_dict({"prompt": [f"<image>{Q}"], "images": [[{"bytes": buf.getvalue(), "path": None}]],
                                     "label": ["green"]},
                                    features=datasets.Features({"prompt": datasets.Value("string"),
                                                                "images": [datasets.Image()],
                                                                "label": datasets.Value("string")}))
    ds.to_parquet(tmp_path / "d.parquet")
    prompts, report = load_prompts(DataConfig(path=str(tmp_path / "d.parquet")), tok, processor=proc)
    assert not report.skipped and prompts[0].prompt_ids.count(proc.image_token_id) == 4
    source = PromptSource(DataConfig(path=str(tmp_path / "d.parquet")), tok, batch_size=1, dp_rank=0, dp_size=1,
                          seed=0, processor=proc)
    assert torch.isfinite(source.next_batch()[0].mm.pixel_values).all()


def test_a_binary_image_column_loads_and_a_file_url_with_a_host_is_named(tmp_path, vl):
    """A parquet column of plain binary (the encoded files, not datasets' Image feature) was skipped as a bad
    reference, each warning printing the whole image as a bytes literal: it loads. file://images/a.png read /a.png
    (`images` is the URL's host): refused, saying how to write a relative or an absolute path."""
    import datasets

    from slime.multimodal.images import ImageError, describe, read_image

    _, tok, proc = vl
    buf = io.BytesIO()
    Image.new("RGB", (60, 50), (10, 200, 10)).save(buf, format="PNG")
    datasets.Dataset.from_dict({"prompt": [f"<image>{Q}"], "images": [[buf.getvalue()]], "label": ["green"]}
                               ).to_parquet(tmp_path / "d.parquet")
    prompts, report = load_prompts(DataConfig(path=str(tmp_path / "d.parquet")), tok, processor=proc)
    assert not report.skipped and prompts[0].prompt_ids.count(proc.image_token_id) == 4
    assert describe(buf.getvalue()) == f"<{len(buf.getvalue())} image bytes>"
    with pytest.raises(ImageError, match=r"image reference int is not a path") as e:
        read_image(7, tmp_path, max_pixels=10**6)
    (tmp_path / "images").mkdir()
    name = png(tmp_path / "images" / "a.png")
    assert read_image(f"file://{tmp_path / 'images' / name}", ".", max_pixels=10**6).size == (60, 50)
    with pytest.raises(ImageError, match=r"file://images/a.png: a file URL names a host \('images'\).*images/a.png"
                                         r".*file:///abs/path") as e:
        read_image(f"file://images/{name}", tmp_path, max_pixels=10**6)
    assert e.value.reason == "bad_reference"


def test_image_rows_refuse_a_turned_off_chat_template(tmp_path, vl):
    _, tok, proc = vl
    path = rows_file(tmp_path, [{"prompt": f"<image>{Q}", "images": [png(tmp_path / "a.png")], "label": "x"}])
    with pytest.raises(ValueError, match=r"d.jsonl:1: image-text rows need the chat template.*apply_chat_template"):
        load_prompts(DataConfig(path=str(path), apply_chat_template=False), tok, processor=proc)


def test_an_image_resized_since_load_is_skipped_when_drawn_and_ids_stay_apart(tmp_path, vl):
    """The prompt's image tokens were counted at load; an image replaced by one of another size is skipped and
    counted when drawn, and the rank's remaining samples keep the group ids and indices of its share."""
    from slime.config import RolloutConfig
    from slime.distributed.parallel_dims import ParallelDims
    from slime.rollout.engine import Generation
    from slime.rollout.rollout import _draw_and_generate

    _, tok, proc = vl
    rows = [{"prompt": f"<image>{Q} {k}", "images": [png(tmp_path / f"{k}.png")], "label": "red"} for k in range(4)]
    source = PromptSource(DataConfig(path=str(rows_file(tmp_path, rows)), shuffle=False), tok, batch_size=4,
                          dp_rank=1, dp_size=2, seed=0, processor=proc)
    png(tmp_path / "2.png", size=(200, 120))  # rank 1 draws rows 2 and 3

    class Engine:
        weight_version = 0

        def generate(self, prompts, params, mm=None):
            return [[Generation([5], [-1.0], "length")] * params.n for _ in prompts]

    class Reward:
        def score(self, samples):
            return [0.0] * len(samples)

    samples = _draw_and_generate(Engine(), source, RolloutConfig(batch_size=4, n_samples_per_prompt=2), tok,
                                 Reward(), ParallelDims(world_size=2, rank=1, local_rank=1, dp=2), step=0, attempt=0,
                                 n_prompts=None)
    assert dict(source.skipped_when_drawn) == {"changed_since_load": 1}
    assert [s.prompt_text.endswith("3<assistant>") for s in samples] == [True, True]
    # rank 1's share of 2 prompts starts at group 2 and sample 4, whatever it kept; rank 0 holds groups 0-1
    assert [s.group_id for s in samples] == [2, 2] and [s.index for s in samples] == [4, 5]


def test_a_raised_pixel_limit_passes_pillows_own(tmp_path, vl, monkeypatch):
    """data.max_image_pixels above Pillow's decompression-bomb limit is what applies (Pillow's would refuse
    such images at open, or warn at decoding, before ours)."""
    from slime.multimodal.images import ImageError, read_image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # stands in for Pillow's 89 Mpx
    Image.new("L", (100, 50)).save(tmp_path / "wide.png")  # 5000 px: beyond 2x Pillow's limit
    assert read_image("wide.png", tmp_path, max_pixels=10_000).size == (100, 50)
    with pytest.raises(ImageError) as e:
        read_image("wide.png", tmp_path, max_pixels=4_000)
    assert e.value.reason == "too_large"


def test_transparent_pixels_are_white_and_extreme_aspect_ratios_are_named(tmp_path, vl):
    """convert("RGB") keeps the colour under transparent pixels: a black line on a transparent (0, 0, 0, 0)
    canvas, the usual diagram, became a black square. And the processor's own refusal of a 250:1 image was
    reported as a placeholder mismatch."""
    from slime.multimodal.images import ImageError, read_image

    img = Image.new("RGBA", (40, 30), (0, 0, 0, 0))
    for x in range(40):
        img.putpixel((x, 15), (0, 0, 0, 255))
    img.save(tmp_path / "diagram.png")
    rgb = read_image("diagram.png", tmp_path, max_pixels=10**6)
    assert rgb.mode == "RGB" and rgb.getpixel((3, 3)) == (255, 255, 255) and rgb.getpixel((3, 15)) == (0, 0, 0)
    img.convert("P").save(tmp_path / "palette.png", transparency=0)
    assert read_image("palette.png", tmp_path, max_pixels=10**6).getpixel((3, 3)) == (255, 255, 255)
    Image.new("RGB", (1000, 4)).save(tmp_path / "strip.png")
    with pytest.raises(ImageError, match="strip.png is 1000x4: the image processor takes no aspect ratio over 200") \
            as e:
        read_image("strip.png", tmp_path, max_pixels=10**6)
    assert e.value.reason == "bad_aspect"
    frames = [Image.new("RGB", (30, 30), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])  # the model saw frame 0 only
    with pytest.raises(ImageError, match=r"anim.gif is animated \(3 frames\); the model takes one image") as e:
        read_image("anim.gif", tmp_path, max_pixels=10**6)
    assert e.value.reason == "unsupported_mode"
    frames[0].save(tmp_path / "still.gif")
    assert read_image("still.gif", tmp_path, max_pixels=10**6).getpixel((3, 3)) == (255, 0, 0)
    # a camera's JPEG with an embedded preview opens as a 2-frame MPO: a still photo, not an animation
    frames[0].save(tmp_path / "photo.jpg", "MPO", save_all=True, append_images=[Image.new("RGB", (8, 8))])
    assert Image.open(tmp_path / "photo.jpg").n_frames == 2
    assert read_image("photo.jpg", tmp_path, max_pixels=10**6).size == (30, 30)


def test_image_bytes_as_base64_text_a_quoted_image_token_and_an_unknown_part_type(tmp_path, vl, caplog):
    """JSON holds an image's {"bytes": ...} as base64 text: it loads (a TypeError stopped the whole load), and text
    that is not base64 is a corrupt image, skipped and named. A text row quoting the image token would have no image
    to fill it: skipped. A part of an unknown type ({"type": "input_image"}) was passed to the template, which
    rendered nothing: the row trained as text without its image; it is named."""
    _, tok, proc = vl
    name = png(tmp_path / "a.png")
    b64 = base64.b64encode((tmp_path / name).read_bytes()).decode()
    rows = [{"prompt": f"<image>{Q}", "images": [name], "label": "red"},
            {"prompt": f"<image>{Q}", "images": [{"bytes": b64, "path": None}], "label": "red"},
            {"prompt": f"<image>{Q}", "images": [{"bytes": "not base64!", "path": None}], "label": "red"},
            {"prompt": "What does <|image_pad|> mean?", "label": "x"}]
    with caplog.at_level(logging.WARNING):
        prompts, report = load_prompts(DataConfig(path=str(rows_file(tmp_path, rows)), max_skipped_frac=1.0), tok,
                                       processor=proc)
    assert [p.index for p in prompts] == [0, 1] and prompts[0].prompt_ids == prompts[1].prompt_ids
    assert dict(report.skipped) == {"corrupt_image": 1, "placeholder_mismatch": 1}
    assert "d.jsonl:3: skipped (corrupt_image): image 'bytes' is a string that is not base64" in caplog.text
    assert "d.jsonl:4: skipped (placeholder_mismatch): the prompt holds 1 image token(s)" in caplog.text
    other = {"messages": [{"role": "user", "content": [{"type": "input_image", "image_url": name},
                                                       {"type": "text", "text": Q}]}], "label": "red"}
    with pytest.raises(TypeError, match=r"d.jsonl:1: 'messages'\[0\].content has a part of type 'input_image'"):
        load_prompts(DataConfig(path=str(rows_file(tmp_path, [other]))), tok, processor=proc)


def test_a_text_row_with_an_image_token_beside_image_rows_is_named():
    """A generate call's image-text rows give their images to every image token of the batch: a text row holding
    one (a custom rollout's context) made transformers' rope index stop with a bare StopIteration."""
    from slime.multimodal.processor import MultimodalInputs, check_contexts

    mm = MultimodalInputs(torch.zeros(16, 8), torch.tensor([[1, 4, 4]]), token_id=7, num_tokens=4)
    check_contexts([[1, 7, 7, 7, 7, 2], [1, 2, 3]], [mm, None])
    check_contexts([[1, 2, 7]], [None])  # no image row: the model reads it as text
    with pytest.raises(ValueError, match=r"text prompt 1 of this generate call holds 1 image token\(s\) \(id 7\)"):
        check_contexts([[1, 7, 7, 7, 7, 2], [1, 2, 7]], [mm, None])


def test_two_images_swapped_since_load_are_skipped_when_drawn(tmp_path, vl, caplog):
    """The total of image tokens stays when a row's two files of different sizes are swapped, but each image's
    run of placeholders no longer fits its features: checked image by image."""
    from slime.data.prompts import with_pixels

    _, tok, proc = vl
    png(tmp_path / "a.png")
    png(tmp_path / "b.png", size=(200, 120))
    cfg = DataConfig(path=str(rows_file(tmp_path, [{"prompt": f"<image><image>{Q}", "images": ["a.png", "b.png"],
                                                    "label": "red"}])))
    prompts, _ = load_prompts(cfg, tok, processor=proc)
    assert len(with_pixels(prompts, cfg, proc, cfg.path)[0]) == 1
    (tmp_path / "a.png").rename(tmp_path / "c.png")
    (tmp_path / "b.png").rename(tmp_path / "a.png")
    (tmp_path / "c.png").rename(tmp_path / "b.png")
    with caplog.at_level(logging.WARNING):
        drawn, skipped = with_pixels(prompts, cfg, proc, cfg.path)
    assert drawn == [] and dict(skipped) == {"changed_since_load": 1}
    assert "d.jsonl:1: skipped when drawn (changed_since_load): its images now make [" in caplog.text


def test_an_http_image_is_fetched_within_the_timeout_in_all_and_a_size_cap():
    """requests' timeout is per read: a server that sends a byte now and then held the rank for ever (and the ranks
    waiting for it in the load's collective). The whole fetch gets data.image_fetch_timeout, and a body larger than
    any image of data.max_image_pixels is refused as it arrives. A body cut short, or a read that times out, is a
    failed fetch."""
    import http.server
    import threading
    import time

    from slime.multimodal.images import ImageError, read_image

    stop = threading.Event()
    buf = io.BytesIO()
    Image.new("RGB", (60, 50), (200, 30, 30)).save(buf, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            if self.path in ("/short.png", "/stall.png"):  # 40 bytes of the file, then it closes or stalls
                self.send_header("Content-Length", str(len(buf.getvalue())))
                self.end_headers()
                self.wfile.write(buf.getvalue()[:40])
                self.wfile.flush()
                if self.path == "/stall.png":
                    stop.wait(30)
                return
            if self.path == "/ok.png":
                self.send_header("Content-Length", str(len(buf.getvalue())))
                self.end_headers()
                self.wfile.write(buf.getvalue())
                return
            self.end_headers()
            try:
                while not stop.is_set():  # never ends: a trickle, or a body without end
                    self.wfile.write(b"x" * (1 if self.path == "/trickle.png" else 1 << 16))
                    self.wfile.flush()
                    if self.path == "/trickle.png":
                        time.sleep(0.05)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert read_image(f"{url}/ok.png", ".", max_pixels=10**6, timeout=60.0).size == (60, 50)
        # A body cut short, or a read that times out, raise urllib3's errors from r.raw, not requests': they ended
        # the whole load (every rank) instead of skipping the row
        for path, timeout, words, reason in [
                ("trickle.png", 1.0, r"took more than data.image_fetch_timeout=1.0 s", "fetch_failed"),
                ("endless.png", 60.0, r"sent more than 9048576 bytes", "too_large"),
                ("short.png", 60.0, r"could not fetch .*/short.png: .*IncompleteRead", "fetch_failed"),
                ("stall.png", 1.0, r"could not fetch .*/stall.png: .*Read timed out", "fetch_failed")]:
            with pytest.raises(ImageError, match=words) as e:
                read_image(f"{url}/{path}", ".", max_pixels=10**6, timeout=timeout)
            assert e.value.reason == reason, path
    finally:
        stop.set()
        httpd.shutdown()


def test_an_sft_label_holding_the_image_token_is_skipped_and_counted(tmp_path, vl):
    """SFT trained such a label's image token as a target (no image fills it: the plain HF model cannot even score
    the row), where a prompt holding it without an image is skipped as placeholder_mismatch."""
    _, tok, proc = vl
    name = png(tmp_path / "a.png")
    rows = [{"prompt": f"<image>{Q}", "images": [name], "label": "red"},
            {"prompt": f"<image>{Q}", "images": [name], "label": f"{proc.image_token} red"},
            {"prompt": Q, "label": f"<|vision_start|>{proc.image_token}<|vision_end|>"}]
    prompts, report = load_prompts(DataConfig(path=str(rows_file(tmp_path, rows)), max_skipped_frac=1.0), tok,
                                   processor=proc, label_required=True, label_is_text=True)
    assert [p.label for p in prompts] == ["red"] and dict(report.skipped) == {"placeholder_mismatch": 2}
    kept, _ = load_prompts(DataConfig(path=str(rows_file(tmp_path, rows)), max_skipped_frac=1.0), tok,
                           processor=proc, label_required=True)  # a reward's label: text it compares, not learned
    assert len(kept) == 3


def test_pixel_limits_that_leave_an_image_one_token_are_refused(vl, caplog):
    """model.min_pixels above max_pixels, or max_pixels below one tile, made every image one image token in silence
    (the run exited 0); 0 failed in transformers after the models loaded, naming no key. On a text model the keys
    were dropped without a word."""
    from slime.config import ModelConfig
    from slime.models.loading import load_processor

    path, tok, default = vl
    for bad, message in (({"min_pixels": 0}, r"model.min_pixels=0: give a positive number"),
                         ({"max_pixels": -5}, r"model.max_pixels=-5: give a positive number"),
                         ({"min_pixels": 10**6, "max_pixels": 100}, r"model.min_pixels=1000000 is above "
                                                                      r"model.max_pixels=100")):
        with pytest.raises(ValueError, match=message):
            ModelConfig(path=str(path), **bad)
    tile = default.factor ** 2
    with pytest.raises(ValueError, match=rf"model.max_pixels=10 .* one {default.factor}x{default.factor} tile.*at "
                                         rf"least {tile}"):
        VLProcessor(str(path), tok, max_pixels=10)
    with pytest.raises(ValueError, match=r"model.max_pixels=\d+ \(model.min_pixels=99999999;"):
        VLProcessor(str(path), tok, min_pixels=99_999_999)  # above the processor's own max_pixels
    assert VLProcessor(str(path), tok, max_pixels=tile).image_tokens(56, 56) == 1  # one tile, as asked
    assert default.image_tokens(56, 56) == 4
    with caplog.at_level(logging.WARNING):
        assert load_processor(ModelConfig(path=str(REPO / "assets/tiny-arith"), max_pixels=4096), tok) is None
    assert "model.max_pixels=4096 ignored: model.path=" in caplog.text
