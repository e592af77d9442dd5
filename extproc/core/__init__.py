"""What every room stands on: the datastore of endpoints and their scraped metrics (`datastore`),
error codes with their HTTP statuses (`errors`), JSON logs (`logs`), and supervised background
tasks (`background`)."""
