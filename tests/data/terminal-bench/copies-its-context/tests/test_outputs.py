# Only run-tests.sh grades this task; the file is here to be kept out of the image.
def test_answer():
    assert open("/app/answer.txt").read().strip() == "octarine"
