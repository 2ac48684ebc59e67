import sys
print('ok' if '--check' in sys.argv else 'result 42')
