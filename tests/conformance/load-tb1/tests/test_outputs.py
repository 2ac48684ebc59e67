from pathlib import Path

COUNT = Path("/app/error_count.txt")


def test_count_file_exists():
    assert COUNT.is_file()


def test_count_is_the_number_of_error_lines():
    assert COUNT.read_text().strip() == "3"


def test_log_is_untouched():
    assert Path("/app/service.log").read_text().count("ERROR") == 3 and COUNT.is_file()
