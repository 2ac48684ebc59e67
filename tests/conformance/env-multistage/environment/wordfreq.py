"""wordfreq FILE: the most frequent word of FILE and its count."""
import collections
import sys

words = open(sys.argv[1]).read().lower().split()
word, count = collections.Counter(words).most_common(1)[0]
print(word, count)
