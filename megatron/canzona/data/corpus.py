"""Documents from text and JSONL files, and Project Gutenberg books cut into documents.

A *document* is the unit Megatron's indexed dataset stores and ends with an EOD token:
a JSONL file holds one document per line (one JSON object, the text under a key); a plain
text file holds one document per block of lines separated by a blank line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json")

# Raw Project Gutenberg files wrap the book in a licence header and trailer; the book text
# is public domain, the trailer is not part of the book and would pollute a tiny corpus.
_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG", re.I | re.M)
_GUTENBERG_END = re.compile(r"^\s*(\*\*\*\s*)?END OF (THE |THIS )?PROJECT GUTENBERG", re.I | re.M)
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def check_input_files(paths: Sequence[str | Path]) -> list[Path]:
    """Return ``paths`` as ``Path`` objects; raise ``ValueError`` for a missing or empty one."""
    if not paths:
        raise ValueError("no input files given: pass --input FILE [FILE ...]")
    checked = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ValueError(f"input file not found: {path} (check the path passed to --input)")
        if not path.is_file():
            raise ValueError(f"input is not a regular file: {path} (pass files, not directories)")
        if path.stat().st_size == 0:
            raise ValueError(f"input file is empty: {path} (give a file that holds text)")
        checked.append(path)
    return checked


def is_jsonl(path: Path) -> bool:
    """True if ``path`` is read as JSONL (by its suffix), False if read as plain text."""
    return path.suffix.lower() in JSONL_SUFFIXES


def iter_documents(path: Path, json_keys: Sequence[str] = ("text",)) -> Iterator[dict[str, str]]:
    """Yield each document of ``path`` as ``{key: text}``.

    JSONL files must hold every key of ``json_keys`` in every record; a plain text file
    yields each blank-line-separated block under the first key.
    """
    if not json_keys:
        raise ValueError("--json-keys needs at least one key, e.g. --json-keys text")
    if is_jsonl(path):
        yield from _iter_jsonl(path, json_keys)
    else:
        for block in _iter_text_blocks(path):
            yield {json_keys[0]: block}


def iter_texts(paths: Iterable[Path], json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Yield every document text of every file, all keys in turn (for tokenizer training)."""
    for path in paths:
        for document in iter_documents(path, json_keys):
            yield from document.values()


def _iter_jsonl(path: Path, json_keys: Sequence[str]) -> Iterator[dict[str, str]]:
    with path.open(encoding="utf-8", errors="replace") as stream:
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{where}: not valid JSON ({error.msg}); each line of a JSONL file must be "
                    'one object such as {"text": "..."}, or name the file .txt to read it as text'
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f'{where}: expected a JSON object such as {{"text": "..."}}')
            yield {key: _text_field(record, key, where) for key in json_keys}


def _text_field(record: dict, key: str, where: str) -> str:
    if key not in record:
        found = ", ".join(sorted(record)) or "none"
        raise ValueError(f"{where}: no key {key!r} (keys found: {found}); pass --json-keys KEY")
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: key {key!r} holds {type(value).__name__}, expected a string")
    return value


def _iter_text_blocks(path: Path) -> Iterator[str]:
    """Yield the blank-line-separated blocks of a text file, streaming line by line."""
    block: list[str] = []
    with path.open(encoding="utf-8", errors="replace", newline=None) as stream:
        for line in stream:
            if line.strip():
                block.append(line.rstrip("\n"))
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def book_paragraphs(text: str) -> list[str]:
    """Cut a plain-text book into paragraphs, undoing the hard line wrapping of e-texts.

    Strips a Project Gutenberg header and trailer when present, so raw downloads and the
    shipped (already stripped) selections give the same kind of text.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[text.find("\n", start.end()) + 1 :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    paragraphs = (" ".join(line.strip() for line in block.splitlines()) for block in _BLANK_LINE.split(text))
    return [paragraph.strip() for paragraph in paragraphs if paragraph.strip()]


def group_paragraphs(paragraphs: Iterable[str], max_chars: int) -> list[str]:
    """Join consecutive paragraphs (with a blank line) into documents of at most ``max_chars``.

    A paragraph longer than ``max_chars`` becomes a document on its own, uncut, so no
    sentence is ever split between documents.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be 1 or more, got {max_chars}")
    documents: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in paragraphs:
        added = len(paragraph) + (2 if current else 0)
        if current and size + added > max_chars:
            documents.append("\n\n".join(current))
            current, size, added = [], 0, len(paragraph)
        current.append(paragraph)
        size += added
    if current:
        documents.append("\n\n".join(current))
    return documents


def books_to_documents(book_paths: Sequence[Path], max_chars: int) -> list[dict[str, str]]:
    """Read plain-text books and return JSONL-ready records ``{"text", "source"}``."""
    records = []
    for path in book_paths:
        paragraphs = book_paragraphs(_read_book(path))
        if not paragraphs:
            raise ValueError(f"no text found in {path}; remove it or give a book with text")
        records.extend({"text": doc, "source": path.name} for doc in group_paragraphs(paragraphs, max_chars))
    return records


def _read_book(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        # Older e-texts are Latin-1; every byte sequence decodes, so nothing is lost.
        return data.decode("latin-1")


def write_jsonl(records: Iterable[dict[str, str]], path: Path) -> int:
    """Write one JSON object per line to ``path`` (atomically) and return the count."""
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as stream:
        for record in records:
            stream.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(path)
    return count
