from pathlib import Path

TEXT = Path("/app/text.txt")


def test_module_installed():
    import wordcount

    assert wordcount.count(str(TEXT)) == len(TEXT.read_text().split())


def test_answer():
    assert Path("/app/answer.txt").read_text().strip() == str(len(TEXT.read_text().split()))


def test_module_counts_another_file(tmp_path):
    import wordcount

    other = tmp_path / "other.txt"
    other.write_text("one two\nthree\n")
    assert wordcount.count(str(other)) == 3
