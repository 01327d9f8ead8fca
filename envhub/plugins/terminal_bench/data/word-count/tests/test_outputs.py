from pathlib import Path


def test_count_file_exists():
    assert Path("/app/count.txt").exists()


def test_count_is_correct():
    assert Path("/app/count.txt").read_text().strip() == "13"


def test_words_file_untouched():
    assert Path("/app/words.txt").read_text().split()[:2] == ["the", "quick"]
