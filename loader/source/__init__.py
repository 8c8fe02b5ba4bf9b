"""What to read: the manifest and its generations, the date selection, an epoch's plan, downloads from object stores."""
