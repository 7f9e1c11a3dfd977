"""Bad training data and tokenizers: a wrong, damaged or half-written file ends in one line naming the file and the
problem (never a traceback or a silently wrong run), and a damaged tokenizer cache is trained again."""
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import bert.train  # noqa: E402
import gpt2.train  # noqa: E402
from utils import hub  # noqa: E402
from utils.data_utils import BUNDLED_SQUAD_SAMPLE, check_data_flags, read_jsonl_corpus, read_squad_json  # noqa: E402
from utils.errors import DataError, UsageError  # noqa: E402
from utils.tokenization import TokenizerRequest, load_tokenizer, trained_tokenizer  # noqa: E402

TEXTS = [f"the cat number {i} sat on the mat near the old mill" for i in range(40)]
GPT2_REQUEST = TokenizerRequest("gpt2", "byte-level-bpe", "tiny", None, 300)
BERT_REQUEST = TokenizerRequest("bert", "wordpiece", "tiny", None, 300, lowercase=True)
CORPUS = "".join(json.dumps({"text": text}) + "\n" for text in TEXTS[:5])


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_decision", None)


@pytest.fixture(scope="module")
def gpt2_tokenizer_dir(tmp_path_factory):
    """A stand-in GPT-2 tokenizer as trained_tokenizer saves it: tokenizer.json and tokenizer_config.json."""
    _, folder = trained_tokenizer(GPT2_REQUEST, TEXTS, tmp_path_factory.mktemp("cache"))
    return folder


def copy_tokenizer(source: Path, target: Path, *, as_vocab_and_merges: bool = False) -> Path:
    """A copy of a saved tokenizer; as_vocab_and_merges writes vocab.json + merges.txt instead of tokenizer.json."""
    target.mkdir()
    (target / "tokenizer_config.json").write_bytes((source / "tokenizer_config.json").read_bytes())
    if not as_vocab_and_merges:
        (target / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
        return target
    model = json.loads((source / "tokenizer.json").read_text())["model"]
    (target / "vocab.json").write_text(json.dumps(model["vocab"]))
    (target / "merges.txt").write_text("#version: 0.2\n" + "".join(" ".join(pair) + "\n" for pair in model["merges"]))
    return target


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ---- data files ------------------------------------------------------------------------------------------------
def test_squad_file_that_is_a_directory_is_named_a_directory(tmp_path):
    with pytest.raises(DataError, match=f"^{tmp_path}: a directory, not a SQuAD JSON file .*--dataset-path"):
        check_data_flags(str(tmp_path), None)


@pytest.mark.parametrize("indent", [1, None], ids=["pretty-printed", "one-line"])
def test_squad_json_given_as_a_jsonl_corpus_points_to_squad_file(tmp_path, indent):
    squad = tmp_path / "train.json"
    squad.write_text(json.dumps(json.loads(BUNDLED_SQUAD_SAMPLE.read_text()), indent=indent))
    with pytest.raises(DataError) as error:
        read_jsonl_corpus(squad)
    assert str(error.value) == (f"{squad}: a SQuAD JSON file, not a JSONL corpus of {{\"text\": ...}} lines; "
                                "pass it with --squad-file")


@pytest.mark.parametrize("lines", [5, 1])
def test_jsonl_corpus_given_as_a_squad_file_points_to_dataset_path(tmp_path, lines):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(CORPUS.splitlines(keepends=True)[:lines]))
    with pytest.raises(DataError, match=r"corpus\.jsonl: a JSONL corpus .* not SQuAD JSON; pass it with --dataset-path"):
        read_squad_json(corpus)


def test_cut_short_and_empty_squad_files_say_so(tmp_path):
    cut = tmp_path / "cut.json"
    cut.write_text(BUNDLED_SQUAD_SAMPLE.read_text()[:3000])
    with pytest.raises(DataError, match=r"cut\.json: not valid JSON: it ends at line \d+, column \d+ before the JSON "
                                        r"does \(cut short\?\)"):
        read_squad_json(cut)
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.json: an empty file, not JSON$"):
        read_squad_json(empty)


def test_a_byte_order_mark_is_read_as_the_utf8_text_it_is(tmp_path):
    squad, corpus = tmp_path / "bom.json", tmp_path / "bom.jsonl"
    squad.write_bytes(b"\xef\xbb\xbf" + BUNDLED_SQUAD_SAMPLE.read_bytes())
    corpus.write_bytes(b"\xef\xbb\xbf" + CORPUS.encode())
    assert read_squad_json(squad) == read_squad_json(BUNDLED_SQUAD_SAMPLE)
    assert [ex.text for ex in read_jsonl_corpus(corpus)] == TEXTS[:5]


def test_a_folder_named_like_a_jsonl_file_in_a_corpus_directory_is_not_read_as_one(tmp_path):
    (tmp_path / "a.jsonl").write_text(CORPUS)
    (tmp_path / "b.jsonl").mkdir()
    assert [ex.text for ex in read_jsonl_corpus(tmp_path)] == TEXTS[:5]


def test_corpus_too_short_for_one_gpt2_block_of_validation_names_the_sequence_length(tmp_path, capsys, monkeypatch):
    from utils import tokenization
    monkeypatch.setattr(tokenization, "TRAINED_TOKENIZER_CACHE", tmp_path / "tokenizers")
    corpus = tmp_path / "short.jsonl"
    corpus.write_text(CORPUS * 2)  # 10 lines of 13 tokens: the one held out fills no 64-token block
    status = gpt2.train.main(["--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "4", "--report-to",
                              "none", "--max-steps", "1", "--dataset-path", str(corpus), "--save-dir",
                              str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: jsonl:{corpus}: the validation split (1 example(s)) fills no sequence of --max-seq-length 64 tokens; "
        "use more data, a larger --validation-fraction or a smaller --max-seq-length"]


# ---- --tokenizer-path ------------------------------------------------------------------------------------------
def damage_cut_tokenizer_json(folder: Path) -> None:
    cut_short(folder / "tokenizer.json")


def damage_cut_vocab_json(folder: Path) -> None:
    cut_short(folder / "vocab.json")


def damage_no_merges(folder: Path) -> None:
    (folder / "merges.txt").unlink()


def damage_empty(folder: Path) -> None:
    for file in folder.iterdir():
        file.unlink()


@pytest.mark.parametrize("vocab_and_merges, damage, problem", [
    (False, damage_cut_tokenizer_json, r"tokenizer\.json is not valid JSON: it ends at .* \(cut short\?\)"),
    (True, damage_cut_vocab_json, r"vocab\.json is not valid JSON: it ends at .* \(cut short\?\)"),
    (True, damage_no_merges, r"it has vocab\.json but no merges\.txt: a BPE tokenizer needs both"),
    (False, damage_empty, r"no vocabulary files there \(tokenizer\.json, vocab\.json \+ merges\.txt, vocab\.txt"),
], ids=["cut-tokenizer.json", "cut-vocab.json", "no-merges.txt", "empty-folder"])
def test_damaged_tokenizer_folder_names_the_file_and_the_problem(gpt2_tokenizer_dir, tmp_path, vocab_and_merges,
                                                                 damage, problem):
    folder = copy_tokenizer(gpt2_tokenizer_dir, tmp_path / "tok", as_vocab_and_merges=vocab_and_merges)
    assert load_tokenizer(GPT2_REQUEST, tokenizer_path=str(folder), cache_dir=None, training_texts=list)
    damage(folder)
    with pytest.raises(UsageError, match=f"^{folder}: cannot load a tokenizer \\({problem}"):
        load_tokenizer(GPT2_REQUEST, tokenizer_path=str(folder), cache_dir=None, training_texts=list)


def test_tokenizer_path_that_is_a_file_asks_for_the_folder(gpt2_tokenizer_dir):
    file = gpt2_tokenizer_dir / "tokenizer.json"
    with pytest.raises(UsageError, match=f"^{file}: a file, not a tokenizer directory"):
        load_tokenizer(GPT2_REQUEST, tokenizer_path=str(file), cache_dir=None, training_texts=list)


def test_gpt2_tokenizer_without_end_of_text_is_refused_rather_than_run_texts_together(gpt2_tokenizer_dir, tmp_path):
    """tokenizer.json alone does not say which token is end-of-text: GPT-2 would pack its texts with no separator."""
    folder = copy_tokenizer(gpt2_tokenizer_dir, tmp_path / "tok")
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(UsageError, match=f"^{folder}: cannot load a tokenizer \\(it has no eos_token, which gpt2 "
                                         r"training needs \(no tokenizer_config\.json there"):
        load_tokenizer(GPT2_REQUEST, tokenizer_path=str(folder), cache_dir=None, training_texts=list)


def test_bert_training_with_a_gpt2_tokenizer_ends_in_one_line(gpt2_tokenizer_dir, tmp_path, capsys):
    status = bert.train.main(["--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "4",
                              "--report-to", "none", "--max-steps", "1", "--tokenizer-path", str(gpt2_tokenizer_dir),
                              "--save-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {gpt2_tokenizer_dir}: cannot load a tokenizer (it has no mask_token, which bert training needs "
        "(not a bert tokenizer?))"]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_downloaded_gpt2_tokenizer_is_found_from_the_repository_root_whose_gpt2_folder_is_source_code(
        gpt2_tokenizer_dir, tmp_path, monkeypatch):
    """`--model-name gpt2` run where the project lives (the Docker image's working folder) names the size, not the
    gpt2/ source folder: the tokenizer the image downloaded must be used, not a stand-in trained offline."""
    from gpt2.model import gpt2_tokenizer_request, resolve_gpt2_config
    from utils import tokenization
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(tokenization, "PRETRAINED_MODELS_DIR", tmp_path)
    copy_tokenizer(gpt2_tokenizer_dir, tmp_path / "gpt2")  # what scripts/download_tokenizers.py leaves there
    tokenizer, source = load_tokenizer(gpt2_tokenizer_request("gpt2", resolve_gpt2_config("gpt2")), tokenizer_path=None,
                                       cache_dir=None, training_texts=lambda: pytest.fail("must not train"))
    assert source == str(tmp_path / "gpt2") and tokenizer.eos_token == "<|endoftext|>"


# ---- the cache of trained stand-in tokenizers ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["cut tokenizer.json", "no tokenizer.json"])
def test_damaged_cached_tokenizer_is_trained_again(tmp_path, caplog, damage):
    first, folder = trained_tokenizer(BERT_REQUEST, TEXTS, tmp_path)
    if damage == "cut tokenizer.json":
        cut_short(folder / "tokenizer.json")
    else:
        (folder / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING):
        again, folder_again = trained_tokenizer(BERT_REQUEST, TEXTS, tmp_path)
    assert folder_again == folder and [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert again("the cat sat")["input_ids"] == first("the cat sat")["input_ids"]
    assert f"{folder}: the cached tokenizer does not load" in caplog.text and "training it again" in caplog.text


def test_trained_tokenizer_cache_defaults_to_the_folder_named_at_call_time(tmp_path, monkeypatch):
    from utils import tokenization
    monkeypatch.setattr(tokenization, "TRAINED_TOKENIZER_CACHE", tmp_path)
    _, folder = trained_tokenizer(GPT2_REQUEST, TEXTS)
    assert folder.parent == tmp_path


def test_processes_training_the_same_tokenizer_at_once_leave_one_whole_cache(tmp_path):
    """Two runs (or ranks without main_process_first) that train the same stand-in at once: each writes a folder of
    its own and renames it into place, so the cache holds one whole tokenizer and no leftovers."""
    code = ("import sys; from pathlib import Path; from utils.tokenization import TokenizerRequest, trained_tokenizer; "
            f"tok, _ = trained_tokenizer(TokenizerRequest('bert', 'wordpiece', 'tiny', None, 300, True), {TEXTS!r}, "
            "Path(sys.argv[1])); print(tok('the cat sat')['input_ids'])")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             text=True) for _ in range(3)]
    outputs = [run.communicate(timeout=120)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0] and len(set(outputs)) == 1
    [folder] = list(tmp_path.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
